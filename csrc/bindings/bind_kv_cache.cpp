// Python bindings of the caches: the contiguous KVCache (kvserve.compat) and the PagedKVCache.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kvserve/kv_cache.h"
#include "kvserve/paged_kv_cache.h"

namespace py = pybind11;

namespace kvserve::bindings {

void bind_kv_cache(py::module_& m) {
  py::class_<KVCache, std::shared_ptr<KVCache>>(m, "KVCache", "Contiguous pre-allocated KV cache of one layer.")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, at::ScalarType, at::Device>(),
           py::arg("max_batch_size"), py::arg("max_seq_len"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("dtype") = at::kFloat, py::arg("device") = at::Device("cpu"))
      .def_static("for_model", &KVCache::for_model, py::arg("max_batch_size"),
                  py::arg("max_seq_len"), py::arg("config"), py::arg("dtype") = at::kFloat,
                  py::arg("device") = at::Device("cpu"),
                  "One KVCache per layer for a model of this config (MLA: its latents).")
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

  py::class_<KVCacheGroup>(m, "KVCacheGroup", "Layers of a paged pool that share block tables.")
      .def_readonly("sliding_window", &KVCacheGroup::sliding_window)
      .def_readonly("layers", &KVCacheGroup::layers)
      .def("__repr__", [](const KVCacheGroup& g) {
        return "KVCacheGroup(sliding_window=" + std::to_string(g.sliding_window) +
               ", layers=" + std::to_string(g.layers.size()) + ")";
      });
  py::class_<KVCacheStateGroup>(m, "KVCacheStateGroup",
                                "The fixed-size states of a model's state-space layers.")
      .def_readonly("layers", &KVCacheStateGroup::layers)
      .def_readonly("conv_dim", &KVCacheStateGroup::conv_dim)
      .def_readonly("conv_kernel", &KVCacheStateGroup::conv_kernel)
      .def_readonly("num_heads", &KVCacheStateGroup::num_heads)
      .def_readonly("head_dim", &KVCacheStateGroup::head_dim)
      .def_readonly("state_size", &KVCacheStateGroup::state_size)
      .def("bytes_per_sequence", &KVCacheStateGroup::bytes_per_sequence, py::arg("conv_dtype"),
           py::arg("ssm_dtype"));
  py::class_<KVCacheLayout>(m, "KVCacheLayout",
                            "Per layer and token: key and value heads, or one MLA latent.")
      .def(py::init<>())
      .def_static("plain", &KVCacheLayout::plain, py::arg("num_layers"), py::arg("num_kv_heads"),
                  py::arg("head_dim"))
      .def_static("for_model", &KVCacheLayout::for_model, py::arg("config"),
                  py::arg("group_sliding_windows") = false,
                  "What a model of this config caches (its latents under MLA); with "
                  "group_sliding_windows, its layers grouped by window as the engine's pool.")
      .def_static("multi_head_equivalent", &KVCacheLayout::multi_head_equivalent,
                  py::arg("config"), "What the same model would cache with plain multi-head K/V.")
      .def_readwrite("num_layers", &KVCacheLayout::num_layers)
      .def_readwrite("num_kv_heads", &KVCacheLayout::num_kv_heads)
      .def_readwrite("head_dim", &KVCacheLayout::head_dim)
      .def_readwrite("value_head_dim", &KVCacheLayout::value_head_dim)
      .def_readwrite("latent", &KVCacheLayout::latent)
      .def("bytes_per_token", &KVCacheLayout::bytes_per_token, py::arg("dtype"))
      .def("bytes_per_slot_token", &KVCacheLayout::bytes_per_slot_token, py::arg("dtype"),
           "Bytes per token of one block id of a paged pool (scales of int8 / fp8 included).")
      .def_readonly("groups", &KVCacheLayout::groups)
      .def_readonly("state", &KVCacheLayout::state)
      .def("has_state", &KVCacheLayout::has_state)
      .def("num_slots", &KVCacheLayout::num_slots)
      .def("group_windows", &KVCacheLayout::group_windows)
      .def("__repr__", [](const KVCacheLayout& l) {
        return "KVCacheLayout(num_layers=" + std::to_string(l.num_layers) +
               ", num_kv_heads=" + std::to_string(l.num_kv_heads) +
               ", head_dim=" + std::to_string(l.head_dim) +
               ", value_head_dim=" + std::to_string(l.value_head_dim) +
               ", latent=" + (l.latent ? "True" : "False") + ")";
      });

  py::class_<PagedKVCache, std::shared_ptr<PagedKVCache>>(
      m, "PagedKVCache",
      "Per-layer pools of KV blocks, key [num_blocks, block_size, num_kv_heads, head_dim] and "
      "value (or one latent per token, MLA); block 0 is the null block.")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, at::Device>(),
           py::arg("num_layers"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype") = at::kFloat,
           py::arg("device") = at::Device("cpu"))
      .def(py::init([](const KVCacheLayout& layout, int64_t num_blocks, int64_t block_size,
                       at::ScalarType dtype, at::Device device, int64_t num_state_slots,
                       std::optional<at::ScalarType> conv_state_dtype,
                       at::ScalarType ssm_state_dtype) {
             return std::make_shared<PagedKVCache>(
                 layout, num_blocks, block_size, dtype, device,
                 StatePoolOptions{num_state_slots, conv_state_dtype.value_or(dtype),
                                  ssm_state_dtype});
           }),
           py::arg("layout"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("dtype") = at::kFloat, py::arg("device") = at::Device("cpu"),
           py::arg("num_state_slots") = 0, py::arg("conv_state_dtype") = py::none(),
           py::arg("ssm_state_dtype") = at::kFloat,
           "A pool of `layout`; one with a state group also gets num_state_slots state slots "
           "(conv states in conv_state_dtype, default dtype; SSM states in ssm_state_dtype).")
      .def_static(
          "from_memory",
          [](int64_t memory_bytes, int64_t num_layers, int64_t block_size, int64_t num_kv_heads,
             int64_t head_dim, at::ScalarType dtype, at::Device device) {
            return std::make_shared<PagedKVCache>(PagedKVCache::from_memory(
                memory_bytes, KVCacheLayout::plain(num_layers, num_kv_heads, head_dim),
                block_size, dtype, device));
          },
          py::arg("memory_bytes"), py::arg("num_layers"), py::arg("block_size"),
          py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype") = at::kFloat,
          py::arg("device") = at::Device("cpu"), "As many blocks as fit in memory_bytes.")
      .def_static(
          "bytes_per_block",
          [](int64_t num_layers, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
             at::ScalarType dtype) {
            return PagedKVCache::bytes_per_block(
                KVCacheLayout::plain(num_layers, num_kv_heads, head_dim), block_size, dtype);
          },
          py::arg("num_layers"), py::arg("block_size"), py::arg("num_kv_heads"),
          py::arg("head_dim"), py::arg("dtype") = at::kFloat)
      .def_static("bytes_per_block",
                  py::overload_cast<const KVCacheLayout&, int64_t, at::ScalarType>(
                      &PagedKVCache::bytes_per_block),
                  py::arg("layout"), py::arg("block_size"), py::arg("dtype") = at::kFloat)
      .def_property_readonly("layout", &PagedKVCache::layout)
      .def("copy_blocks", &PagedKVCache::copy_blocks, py::arg("copies"),
           "Copies whole blocks in every layer; copies is a list of (src, dst).")
      .def_property_readonly("key_caches", [](const PagedKVCache& c) {
        std::vector<at::Tensor> keys;
        for (int64_t l = 0; l < c.num_layers(); ++l) keys.push_back(c.layers()[l].key);
        return keys;
      })
      .def_property_readonly("value_caches", [](const PagedKVCache& c) {
        std::vector<at::Tensor> values;
        for (int64_t l = 0; l < c.num_layers(); ++l) values.push_back(c.layers()[l].value);
        return values;
      })
      .def_property_readonly(
          "conv_states",
          [](const PagedKVCache& c) {
            std::vector<at::Tensor> states;
            for (size_t l = c.num_layers(); l < c.layers().size(); ++l) {
              states.push_back(c.layers()[l].key);
            }
            return states;
          },
          "Per state-space layer, its conv states [slots, conv_dim, conv_kernel - 1].")
      .def_property_readonly(
          "ssm_states",
          [](const PagedKVCache& c) {
            std::vector<at::Tensor> states;
            for (size_t l = c.num_layers(); l < c.layers().size(); ++l) {
              states.push_back(c.layers()[l].value);
            }
            return states;
          },
          "Per state-space layer, its SSM states [slots, heads, head_dim, state_size].")
      .def_property_readonly("num_state_slots", &PagedKVCache::num_state_slots)
      .def_property_readonly("state_bytes_per_sequence", &PagedKVCache::state_bytes_per_sequence)
      .def_property_readonly(
          "key_scales",
          [](const PagedKVCache& c) {
            std::vector<at::Tensor> scales;
            for (const auto& layer : c.layers()) {
              if (layer.key_scale.defined()) scales.push_back(layer.key_scale);
            }
            return scales;
          },
          "Per layer, the fp32 scales [num_blocks, block_size, num_kv_heads] of an int8 / fp8 "
          "pool (empty for a pool in the model's dtype).")
      .def_property_readonly("value_scales",
                             [](const PagedKVCache& c) {
                               std::vector<at::Tensor> scales;
                               for (const auto& layer : c.layers()) {
                                 if (layer.value_scale.defined()) {
                                   scales.push_back(layer.value_scale);
                                 }
                               }
                               return scales;
                             })
      .def_property_readonly("dtype", &PagedKVCache::dtype)
      .def_property_readonly("num_layers", &PagedKVCache::num_layers)
      .def_property_readonly("num_blocks", &PagedKVCache::num_blocks)
      .def_property_readonly("block_size", &PagedKVCache::block_size)
      .def_property_readonly("num_kv_heads", &PagedKVCache::num_kv_heads)
      .def_property_readonly("head_dim", &PagedKVCache::head_dim)
      .def_property_readonly("capacity_tokens", &PagedKVCache::capacity_tokens)
      .def_property_readonly("bytes_per_token", &PagedKVCache::bytes_per_token)
      .def_property_readonly("nbytes", &PagedKVCache::nbytes)
      .def("__repr__", [](const PagedKVCache& c) {
        return "PagedKVCache(num_layers=" + std::to_string(c.num_layers()) +
               ", num_blocks=" + std::to_string(c.num_blocks()) +
               ", block_size=" + std::to_string(c.block_size()) +
               ", capacity_tokens=" + std::to_string(c.capacity_tokens()) + ")";
      });
}

}  // namespace kvserve::bindings
