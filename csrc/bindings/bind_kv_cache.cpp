// Python bindings of KVCache and the notes' simple cached forward.
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "kvserve/kv_cache.h"

namespace py = pybind11;

namespace kvserve::bindings {

void bind_kv_cache(py::module_& m) {
  py::class_<KVCache, std::shared_ptr<KVCache>>(m, "KVCache", "Contiguous pre-allocated KV cache of one layer.")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, at::ScalarType, at::Device>(),
           py::arg("max_batch_size"), py::arg("max_seq_len"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("dtype") = at::kFloat, py::arg("device") = at::Device("cpu"))
      .def_static("from_model_config", &KVCache::from_model_config, py::arg("max_batch_size"),
                  py::arg("max_seq_len"), py::arg("num_layers"), py::arg("num_kv_heads"),
                  py::arg("head_dim"), py::arg("dtype") = at::kFloat,
                  py::arg("device") = at::Device("cpu"), "One KVCache per layer.")
      .def("reset", &KVCache::reset, "Empties every row; buffers stay allocated.")
      .def("advance", &KVCache::advance, py::arg("row"), py::arg("num_tokens"))
      .def("seq_len", &KVCache::seq_len, py::arg("row"))
      .def_property_readonly("seq_lens", &KVCache::seq_lens)
      .def_property_readonly("key", &KVCache::key)
      .def_property_readonly("value", &KVCache::value)
      .def_property_readonly("max_batch_size", &KVCache::max_batch_size)
      .def_property_readonly("max_seq_len", &KVCache::max_seq_len)
      .def_property_readonly("num_kv_heads", &KVCache::num_kv_heads)
      .def_property_readonly("head_dim", &KVCache::head_dim)
      .def_property_readonly("nbytes", &KVCache::nbytes);
}

}  // namespace kvserve::bindings
