"""One compile: its key, the headers it reads, manifests, explain, symbol maps."""
