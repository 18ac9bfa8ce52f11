"""pyspecter: run Mixture-of-Experts models bigger than fast memory on llama.cpp."""

__version__ = "0.1.0"
