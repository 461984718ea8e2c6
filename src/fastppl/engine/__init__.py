"""The scoring engine: per-token NLL from hidden states, and the loop that sums it on the device."""
