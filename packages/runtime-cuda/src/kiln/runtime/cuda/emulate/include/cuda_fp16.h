// kiln CUDA emulation: stands in for the toolkit's cuda_fp16.h (the types live in the shim)
#pragma once
#include "kiln_cuda_shim.h"
