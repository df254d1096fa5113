"""The shared spec: one set of weights in both frameworks, compared on every backend present."""
