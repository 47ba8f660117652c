"""Graph clean-ups applied to the exported models (onnx-ir), cheap enough to run on every export."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir


def fold_weight_transposes(model: ir.Model) -> int:
    """Replace Transpose(initializer) by a transposed initializer, so MatMuls read weights directly.

    torch.onnx writes nn.Linear as MatMul(x, Transpose(W)); ONNX Runtime then transposes every weight at load,
    and weight-only quantizers, which look for MatMul with a constant B, skip them. Returns the count folded.
    """
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "":
            continue
        src = node.inputs[0]
        if src is None or not src.is_initializer() or src.const_value is None:
            continue
        if len(src.uses()) != 1:
            continue
        perm_attr = node.attributes.get("perm")
        array = src.const_value.numpy()
        perm = list(perm_attr.as_ints()) if perm_attr is not None else list(reversed(range(array.ndim)))
        out = node.outputs[0]
        new = ir.Value(name=f"{src.name}.T", shape=ir.Shape([array.shape[p] for p in perm]), type=src.type,
                       const_value=ir.tensor(np.ascontiguousarray(array.transpose(perm)), name=f"{src.name}.T"))
        graph.register_initializer(new)
        ir.convenience.replace_all_uses_with(out, new)
        graph.remove(node, safe=True)
        del graph.initializers[src.name]
        folded += 1
    return folded


def optimize_graph(model: ir.Model) -> None:
    """Constant folding and clean-up (onnxscript's optimizer) without inlining, so dspark functions stay calls.

    Runs after fold_weight_transposes, so no large initializer needs folding: the size limits keep it fast.
    This turns CastLike of constants and computed axes into initializers, which the TensorRT parser requires."""
    import onnxscript.optimizer

    onnxscript.optimizer.optimize(model, inline=False, input_size_limit=1 << 16, output_size_limit=1 << 20)
