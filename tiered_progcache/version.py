"""This package's version: one literal, read by the build (pyproject's dynamic version) and by the manifests."""

VERSION = "0.1.0"
