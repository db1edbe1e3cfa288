#pragma once
// Declarations shared by the binding files: one bind_<thing>() per bound class.

#include <torch/csrc/utils/pybind.h>

namespace kvserve::bindings {

void bind_kv_cache(pybind11::module_& m);
void bind_continuous_batching_engine(pybind11::module_& m);
void bind_model(pybind11::module_& m);
void bind_paged_block_manager(pybind11::module_& m);
void bind_sampler(pybind11::module_& m);
void bind_tensor_parallel_worker(pybind11::module_& m);

}  // namespace kvserve::bindings
