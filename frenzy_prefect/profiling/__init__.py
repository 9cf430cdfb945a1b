"""Derive the job's specs from what the user gave: model presets/configs and datasets."""
