"""Convoy's bridges to other tools: tracking sinks (TensorBoard, MLflow), Prometheus metrics on
Ray, Ray Train reports, and Lightning modules. Each imports its library lazily, so the engine
and ``import convoy`` work without any of them."""
