import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # onnx_case.py: the ONNX tests' shared model builder and onnxruntime check
