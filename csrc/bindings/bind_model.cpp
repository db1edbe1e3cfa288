// Python bindings of ModelConfig, the forward batch, the models (CausalLM) and the communicator
// their sharded layers use (here rather than in a file of its own: a binding file costs the
// build ~8 s of compile time).
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kvserve/communicator.h"
#include "kvserve/forward_batch.h"
#include "kvserve/kv_cache.h"
#include "kvserve/paged_kv_cache.h"
#include "layers/weights.h"
#include "models/model_factory.h"
#include "models/eagle3_head.h"
#include "models/mtp_head.h"

namespace py = pybind11;

namespace kvserve::bindings {
namespace {

/// A Python attribute per field of a config struct's field list (kvserve/model_config.h).
#define KVSERVE_BIND_FIELD(type, name, init) cls.def_readwrite(#name, &Config::name);

void bind_config(py::module_& m) {
  {
    using Config = RopeScaling;
    py::class_<Config> cls(m, "RopeScaling");
    cls.def(py::init<>());
    KVSERVE_ROPE_SCALING_FIELDS(KVSERVE_BIND_FIELD)
  }
  {
    using Config = MLAConfig;
    py::class_<Config> cls(m, "MLAConfig");
    cls.def(py::init<>());
    KVSERVE_MLA_CONFIG_FIELDS(KVSERVE_BIND_FIELD)
    cls.def_property_readonly("qk_head_dim", &MLAConfig::qk_head_dim);
  }
  {
    using Config = MoEConfig;
    py::class_<Config> cls(m, "MoEConfig");
    cls.def(py::init<>());
    KVSERVE_MOE_CONFIG_FIELDS(KVSERVE_BIND_FIELD)
  }
  {
    using Config = SSMConfig;
    py::class_<Config> cls(m, "SSMConfig");
    cls.def(py::init<>());
    KVSERVE_SSM_CONFIG_FIELDS(KVSERVE_BIND_FIELD)
    cls.def_property_readonly("inner_size", &SSMConfig::inner_size)
        .def_property_readonly("conv_dim", &SSMConfig::conv_dim);
  }
  {
    using Config = QuantizationConfig;
    py::class_<Config> cls(m, "QuantizationConfig");
    cls.def(py::init<>());
    KVSERVE_QUANTIZATION_CONFIG_FIELDS(KVSERVE_BIND_FIELD)
  }
  using Config = ModelConfig;
  py::class_<Config> cls(m, "ModelConfig");
  cls.def(py::init<>());
  cls.def(py::init<const ModelConfig&>(), py::arg("other"), "A copy of `other`.");
  KVSERVE_MODEL_CONFIG_FIELDS(KVSERVE_BIND_FIELD)
  cls.def("kv_source", &ModelConfig::kv_source, py::arg("layer"))
      .def("num_kv_layers", &ModelConfig::num_kv_layers)
      .def("kv_cache_index", &ModelConfig::kv_cache_index, py::arg("layer"))
      .def("state_cache_index", &ModelConfig::state_cache_index, py::arg("layer"))
      .def("num_ssm_layers", &ModelConfig::num_ssm_layers)
      .def("has_mixer", &ModelConfig::has_mixer, py::arg("layer"))
      .def("has_attention", &ModelConfig::has_attention, py::arg("layer"))
      .def("mlp_only", &ModelConfig::mlp_only, py::arg("layer"))
      .def("has_mlp", &ModelConfig::has_mlp, py::arg("layer"))
      .def("use_mla", &ModelConfig::use_mla)
      .def("is_moe_layer", &ModelConfig::is_moe_layer, py::arg("layer"))
      .def("validate", &ModelConfig::validate);
}

#undef KVSERVE_BIND_FIELD

void bind_forward_batch(py::module_& m) {
  py::class_<ForwardBatch>(m, "ForwardBatch", "The flattened tensors of one forward pass.")
      .def_readonly("input_ids", &ForwardBatch::input_ids)
      .def_readonly("positions", &ForwardBatch::positions)
      .def_readonly("metadata", &ForwardBatch::metadata)
      .def_readonly("logits_indices", &ForwardBatch::logits_indices);
  py::class_<ForwardBatchBuilder>(m, "ForwardBatchBuilder")
      .def(py::init<int64_t, bool>(), py::arg("block_size"), py::arg("lora") = false)
      .def("add", &ForwardBatchBuilder::add, py::arg("tokens"), py::arg("num_cached"),
           py::arg("block_table"), py::arg("lora_slot") = -1, py::arg("state_slot") = -1,
           "Appends a sequence's new tokens; its first num_cached tokens are already cached.")
      .def(
          "build",
          [](const ForwardBatchBuilder& builder, at::Device device, int64_t table_width) {
            return builder.build(device, table_width);
          },
          py::arg("device") = at::Device("cpu"), py::arg("table_width") = 0)
      .def_property_readonly("num_sequences", &ForwardBatchBuilder::num_sequences);
}

void bind_causal_lm(py::module_& m) {
  py::class_<AttentionMetadata>(m, "AttentionMetadata")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(), py::arg("slot_mapping"),
           py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"))
      .def_readwrite("slot_mapping", &AttentionMetadata::slot_mapping)
      .def_readwrite("query_start_loc", &AttentionMetadata::query_start_loc)
      .def_readwrite("seq_lens", &AttentionMetadata::seq_lens)
      .def_readwrite("block_tables", &AttentionMetadata::block_tables)
      .def_readwrite("host_query_start_loc", &AttentionMetadata::host_query_start_loc)
      .def_readwrite("host_seq_lens", &AttentionMetadata::host_seq_lens)
      .def_readwrite("host_block_tables", &AttentionMetadata::host_block_tables)
      .def_readwrite("lora_slots", &AttentionMetadata::lora_slots)
      .def_readwrite("state_slots", &AttentionMetadata::state_slots)
      .def_readwrite("has_initial_state", &AttentionMetadata::has_initial_state);

  py::class_<CausalLM, std::shared_ptr<CausalLM>>(m, "CausalLM", "A loaded decoder-only model.")
      .def(
          "forward",
          [](CausalLM& model, const at::Tensor& input_ids, const at::Tensor& positions,
             const AttentionMetadata& metadata,
             const std::vector<std::shared_ptr<KVCache>>& caches) {
            std::vector<LayerKVCache> views;
            for (const auto& cache : caches) views.push_back(cache->layer_view());
            return model.forward(input_ids, positions, metadata, views);
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("metadata"), py::arg("kv_caches"),
          py::call_guard<py::gil_scoped_release>(),
          "Hidden states [T, hidden] of a flattened batch; writes K/V at metadata.slot_mapping.")
      .def(
          "forward",
          [](CausalLM& model, const at::Tensor& input_ids, const at::Tensor& positions,
             const AttentionMetadata& metadata, const PagedKVCache& cache) {
            return model.forward(input_ids, positions, metadata, cache.layers());
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("metadata"), py::arg("kv_cache"),
          py::call_guard<py::gil_scoped_release>(),
          "The same over a PagedKVCache (slots and block tables index its blocks).")
      .def("compute_logits", &CausalLM::compute_logits, py::arg("hidden"),
           py::call_guard<py::gil_scoped_release>())
      .def("capture_hidden_states", &CausalLM::capture_hidden_states, py::arg("layers"),
           "From the next forward on, keep the residual stream entering each of `layers` "
           "(an EAGLE-3 head reads them); [] keeps none.")
      .def("captured_hidden_states", &CausalLM::captured_hidden_states,
           "The last forward's kept streams side by side, [T, layers * hidden], or None.")
      .def(
          "__call__",
          [](CausalLM& model, const at::Tensor& input_ids,
             const std::vector<std::shared_ptr<KVCache>>& kv_caches) {
            std::vector<KVCache*> caches;
            for (const auto& cache : kv_caches) caches.push_back(cache.get());
            return forward_with_kv_cache(model, input_ids, caches);
          },
          py::arg("input_ids"), py::arg("kv_caches"), py::call_guard<py::gil_scoped_release>(),
          "The simple loop (kvserve.compat): input_ids [B, S] appended to the caches; returns logits [B, S, V].")
      .def_property_readonly("config", &CausalLM::config, py::return_value_policy::reference_internal)
      .def_property_readonly("dtype", &CausalLM::dtype)
      .def_property_readonly("device", &CausalLM::device)
      .def_property_readonly("weight_bytes", &CausalLM::weight_bytes)
      .def_property_readonly("embedding_bytes", &CausalLM::embedding_bytes)
      .def(
          "lora_targets",
          [](CausalLM& model) {
            std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> out;
            for (const LoraTarget& t : model.lora_targets()) {
              out.emplace_back(t.name, t.in_features, t.out_features, t.rank);
            }
            return out;
          },
          "(name, in_features, out_features, rank) of every projection that can serve LoRA "
          "adapters (rank 0 until enable_lora).")
      .def("enable_lora", &CausalLM::enable_lora, py::arg("slots"), py::arg("rank"),
           "Room for `slots` adapters of rank up to `rank` in every LoRA target (before serving).")
      .def_property_readonly("num_lora_slots", &CausalLM::num_lora_slots);

  py::class_<DraftHead, CausalLM, std::shared_ptr<DraftHead>>(
      m, "DraftHead", "A speculative head that drafts from the target's hidden states.")
      .def_property_readonly("num_depths", &DraftHead::num_depths)
      .def("target_states", &DraftHead::target_states, py::arg("hidden"),
           py::call_guard<py::gil_scoped_release>(),
           "What depth 0 reads of the target's last forward, from its final hidden states.")
      .def(
          "forward_depth",
          [](DraftHead& head, int64_t depth, const at::Tensor& input_ids,
             const at::Tensor& previous, const at::Tensor& positions,
             const AttentionMetadata& metadata, const PagedKVCache& cache) {
            DraftHead::Output out = head.forward_depth(depth, input_ids, previous, positions,
                                                       metadata, cache.layers());
            return std::make_tuple(out.for_logits, out.for_next);
          },
          py::arg("depth"), py::arg("input_ids"), py::arg("previous"), py::arg("positions"),
          py::arg("metadata"), py::arg("kv_cache"), py::call_guard<py::gil_scoped_release>(),
          "Depth `depth` over rows of a flattened batch: (the rows its logits come from, what "
          "the next depth reads).");

  py::class_<MtpHead, DraftHead, std::shared_ptr<MtpHead>>(
      m, "MtpHead",
      "A checkpoint's multi-token-prediction modules (speculative_method=\"mtp\"; "
      "kvserve.loader.mtp_weights loads them).")
      .def(py::init([](const ModelConfig& config, std::shared_ptr<CausalLM> target,
                       const std::vector<std::shared_ptr<CausalLM>>& blocks,
                       std::unordered_map<std::string, at::Tensor> weights) {
             const WeightMap w(std::move(weights), config.quantization);
             std::vector<MtpHead::Depth> depths;
             for (size_t d = 0; d < blocks.size(); ++d) {
               const std::string p = "layers." + std::to_string(d) + ".";
               depths.push_back({blocks[d], RMSNorm(w.get(p + "enorm.weight"), config.rms_norm_eps),
                                 RMSNorm(w.get(p + "hnorm.weight"), config.rms_norm_eps),
                                 Linear::load(w, p + "eh_proj")});
             }
             return std::make_shared<MtpHead>(config, std::move(target), std::move(depths));
           }),
           py::arg("config"), py::arg("target"), py::arg("blocks"), py::arg("weights"),
           "config: the target's with one layer per module; blocks: each module's decoder layer "
           "(a one-layer CausalLM whose final norm is the module's); weights: "
           "layers.<d>.enorm.weight, .hnorm.weight and .eh_proj.weight (or quantized).");

  py::class_<Eagle3Head, DraftHead, std::shared_ptr<Eagle3Head>>(
      m, "Eagle3Head",
      "An EAGLE-3 head (speculative_method=\"eagle3\"; kvserve.loader.eagle3_weights loads it).")
      .def(py::init([](const ModelConfig& config, std::shared_ptr<CausalLM> target,
                       std::unordered_map<std::string, at::Tensor> weights, int64_t max_positions,
                       bool norm_before_residual) {
             return std::make_shared<Eagle3Head>(
                 config, std::move(target), WeightMap(std::move(weights), config.quantization),
                 max_positions, norm_before_residual);
           }),
           py::arg("config"), py::arg("target"), py::arg("weights"), py::arg("max_positions"),
           py::arg("norm_before_residual") = false,
           "config: the head's decoder layer as a one-layer Llama (the target's vocab_size); "
           "target: its captured streams (capture_hidden_states) feed the head; weights: "
           "loader names (fc, layers.0.*, norm, lm_head, d2t, optionally embed_tokens).");

  m.def("model_families", &model_families);
  m.def("create_causal_lm", &create_causal_lm, py::arg("config"), py::arg("weights"),
        py::arg("max_positions"), py::arg("communicator") = nullptr,
        "The model of config.family; with a communicator of several ranks, config and weights "
        "are this rank's share (kvserve.loader.shard_config / load_weights(shard=...)).");
}

void bind_communicator(py::module_& m) {
  // Collectives block until every rank takes part: they run without the GIL.
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "Collectives over a torch.distributed process group (kvserve.distributed), or local.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def(
          "all_reduce_",
          [](Communicator& c, at::Tensor tensor) {
            c.all_reduce_(tensor);
            return tensor;
          },
          py::arg("tensor"), release(), "Sums the tensor over the ranks in place; returns it.")
      .def("all_gather", &Communicator::all_gather, py::arg("tensor"), py::arg("dim") = 0,
           release())
      .def("gather", &Communicator::gather, py::arg("tensor"), py::arg("dim") = 0,
           py::arg("root") = 0, release(), "The concatenation on `root`; None elsewhere.")
      .def(
          "broadcast_",
          [](Communicator& c, at::Tensor tensor, int64_t root) {
            c.broadcast_(tensor, root);
            return tensor;
          },
          py::arg("tensor"), py::arg("root") = 0, release())
      .def("barrier", &Communicator::barrier, release())
      .def("__repr__", [](const Communicator& c) {
        return "<Communicator " + c.describe() + ", rank " + std::to_string(c.rank()) + " of " +
               std::to_string(c.size()) + ">";
      });
  m.def("local_communicator", &local_communicator);
  m.def("process_group_communicator", &process_group_communicator, py::arg("group_name"),
        "The communicator over the torch.distributed group registered under this name.");
}

}  // namespace

void bind_model(py::module_& m) {
  bind_config(m);
  bind_forward_batch(m);
  bind_causal_lm(m);
  bind_communicator(m);
}

}  // namespace kvserve::bindings
