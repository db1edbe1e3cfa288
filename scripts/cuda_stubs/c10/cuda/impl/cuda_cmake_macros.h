#pragma once
// Compile-check stand-in (see ../../../README.md) for the header a CUDA build of torch generates.
#define C10_CUDA_BUILD_SHARED_LIBS
