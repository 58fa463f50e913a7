"""The model layer (bottom): the configuration, attention, the Transformer, its CPU kernels, int8."""
