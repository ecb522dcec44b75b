"""Position encodings, one module each, on the bias interface of :mod:`relpos.core`."""
