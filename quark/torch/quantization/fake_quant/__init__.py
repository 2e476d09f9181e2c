"""The fake-quantization modules by family; ``quark.torch.quantization.tensor_quantize`` is the path to all of them."""
