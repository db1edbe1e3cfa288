// Tensor parallelism's worker ranks (tensor_parallel_worker.h) for Python: the process of a
// rank > 0 makes its shard and its TensorParallelWorker, then serve()s until rank 0 stops it.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "kvserve/tensor_parallel_worker.h"
#include "models/draft_head.h"

namespace py = pybind11;

namespace kvserve::bindings {

void bind_tensor_parallel_worker(py::module_& m) {
  py::class_<TensorParallelWorker>(
      m, "TensorParallelWorker",
      "A rank > 0 of a tensor-parallel model: its shard and a KV pool of rank 0's blocks; "
      "serve() runs the forward of every step rank 0's engine sends.")
      .def(py::init([](std::shared_ptr<CausalLM> model, std::shared_ptr<Communicator> control,
                       int64_t num_blocks, int64_t block_size,
                       std::optional<at::ScalarType> kv_cache_dtype, int64_t num_state_slots,
                       std::optional<at::ScalarType> ssm_state_dtype,
                       std::shared_ptr<DraftHead> head) {
             return std::make_unique<TensorParallelWorker>(
                 std::move(model), std::move(control),
                 TensorParallelWorkerOptions{num_blocks, block_size, kv_cache_dtype,
                                             num_state_slots, ssm_state_dtype},
                 std::move(head));
           }),
           py::arg("model"), py::arg("control"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("kv_cache_dtype") = py::none(), py::arg("num_state_slots") = 0,
           py::arg("ssm_state_dtype") = py::none(), py::arg("head") = nullptr,
           "head: this rank's shard of a speculative head split with the model (MTP modules), "
           "which runs each depth rank 0's proposer sends.")
      .def("serve", &TensorParallelWorker::serve, py::call_guard<py::gil_scoped_release>(),
           "Runs rank 0's steps until it stops the workers; the number of steps. Raises when the "
           "control group fails (rank 0 gone, or its timeout).")
      .def_property_readonly("kv_cache", &TensorParallelWorker::kv_cache,
                             py::return_value_policy::reference_internal);
}

}  // namespace kvserve::bindings
