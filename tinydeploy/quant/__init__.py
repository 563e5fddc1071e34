"""8-bit quantisation: the arithmetic (params.py), the QDQ pass that turns DQ -> op -> Q islands
into integer operators (qdq.py, with each operator's match in tinydeploy/ops/), and tinydeploy's
exact numpy reference of it (exact.py). docs/quantization.md defines the arithmetic.

This package face imports nothing, so that the operators (which use params.py) and the pass (which
reads the operator registry) never import each other through it."""
