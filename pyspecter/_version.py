"""The package's version, in a module of its own so that modules below the API can read it without importing the
package root (which re-exports the API from above them)."""

__version__ = "0.1.0"
