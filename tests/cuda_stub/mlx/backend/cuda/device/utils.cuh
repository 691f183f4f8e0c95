// Stand-in for MLX's own device header, for compiling the kernel source without
// MLX's CUDA build: only what a custom kernel's generated code relies on.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
