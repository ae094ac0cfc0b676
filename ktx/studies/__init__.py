"""Experiment drivers that sweep configurations (the MetaBalance recommendation study)."""
