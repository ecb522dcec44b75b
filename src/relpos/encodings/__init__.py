"""Position encodings, one module each, and the bias interface they share (``bias``)."""
