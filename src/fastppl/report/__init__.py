"""Result assembly, metrics, output files, the summary, run comparison and plots."""
