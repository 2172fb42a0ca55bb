"""Distributed contrastive pretraining of sentence encoders, aimed first at Chinese short text."""

__version__ = "0.1.0"
