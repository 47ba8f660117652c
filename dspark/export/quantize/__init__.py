"""Weight-only quantization of bundle graphs (MatMulNBits; a GGUF target keeps its blocks): `dspark-export quantize`."""
