"""Where entries live: the store interfaces, the local directory, fsspec and Redis stores, their codec, request door and framing checks."""
