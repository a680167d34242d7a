"""A calculator-using agent trained by astraflow from outside its source tree (see README.md)."""
