"""fastppl bench: fastppl beside its peers in one process and one run, with shared timers."""
