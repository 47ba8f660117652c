"""Bundle export, by role: trace/ (torch.onnx, the bundle), twins/ (ONNX Runtime's own graphs), quantize/, check/.

graphs.py and stamp.py hold the torch modules that are traced, and stay here: every exported graph records their
module path, file and line numbers in its nodes' metadata (pkg.torch.onnx.class_hierarchy, .stack_trace), so moving
or editing them changes the bytes of the graphs exported."""
