"""Quantized layers."""
