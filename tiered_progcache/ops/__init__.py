"""What operators run: the command line, bundles, prune, metrics, run statistics."""
