"""Stages 1 and 2: dataset sources, readers, format adapters, packaged data, the survey and prompt prep."""
