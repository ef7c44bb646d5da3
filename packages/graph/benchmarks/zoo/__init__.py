"""The model zoo: real architectures (torchvision, timm, transformers built from small configs, random weights, nothing
downloaded) and the trained ONNX files that ship inside installed wheels, each exported with torch.onnx.export (dynamo=True,
torch's default, and dynamo=False) at fixed sizes and with a dynamic batch (and sequence), then loaded with kiln.graph.onnx
and run against onnxruntime. It measures how many real models kiln loads and runs right, and ranks what blocks the rest.

Bench environment only (torch, torchvision, timm, transformers, onnxscript): `scripts/zoo`. Modules: spec (what a model
entry is), models_tv / models_timm / models_hf / models_files (the list by family), catalog (all of them), tvshim (lets the
registry's CUDA torchvision import beside CPU torch), export (child: build and export one model), check (child: kiln against
onnxruntime for one model's exports), cache (keys and JSON results), runner (children, timeouts, -j), report (markdown)."""
