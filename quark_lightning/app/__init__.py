"""The Hydra application behind train.py: config composition checks, the run, the sweep summary."""
