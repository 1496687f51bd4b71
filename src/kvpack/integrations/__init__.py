"""Integrations with other libraries. Submodules import their library (transformers, ...) on import;
this package itself imports nothing heavy."""
