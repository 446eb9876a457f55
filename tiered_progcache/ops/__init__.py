"""What operators run: the command line, transfer, bundles, prune, metrics, run statistics."""
