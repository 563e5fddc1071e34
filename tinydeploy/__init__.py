"""tinydeploy: ONNX models to self-contained, static-memory C.

The pipeline, in the order a model goes through it:
    importer (ONNX -> ir.Graph) -> passes (rewrites) -> planner (arena offsets)
    -> codegen (C project) -> build (compiler) -> runner (execute, compare with onnxruntime)
"""
__version__ = "0.1.0"
