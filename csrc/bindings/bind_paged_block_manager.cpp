// Python bindings of the PagedBlockManager and its BlockCopy.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings/bindings.h"
#include "kvserve/paged_block_manager.h"

namespace py = pybind11;

namespace kvserve::bindings {

void bind_paged_block_manager(py::module_& m) {
  py::class_<BlockCopy>(m, "BlockCopy", "Copy block src into block dst before writing dst.")
      .def(py::init<int32_t, int32_t>(), py::arg("src"), py::arg("dst"))
      .def_readonly("src", &BlockCopy::src)
      .def_readonly("dst", &BlockCopy::dst)
      .def(py::self == py::self)
      .def("__repr__", [](const BlockCopy& c) {
        return "BlockCopy(src=" + std::to_string(c.src) + ", dst=" + std::to_string(c.dst) + ")";
      });

  py::class_<StateCopy>(m, "StateCopy", "Copy state slot src into slot dst before the step.")
      .def(py::init<int32_t, int32_t>(), py::arg("src"), py::arg("dst"))
      .def_readonly("src", &StateCopy::src)
      .def_readonly("dst", &StateCopy::dst)
      .def(py::self == py::self)
      .def("__repr__", [](const StateCopy& c) {
        return "StateCopy(src=" + std::to_string(c.src) + ", dst=" + std::to_string(c.dst) + ")";
      });

  using M = PagedBlockManager;
  py::class_<M>(m, "PagedBlockManager",
                "KV cache block ids, reference counts and prefix cache; block 0 is the null block.")
      .def(py::init([](int64_t num_blocks, int64_t block_size, bool enable_prefix_caching,
                       double watermark, std::vector<int64_t> group_windows,
                       int64_t num_state_slots, int64_t num_state_snapshots,
                       bool state_backups) {
             return M({.num_blocks = num_blocks,
                       .block_size = block_size,
                       .enable_prefix_caching = enable_prefix_caching,
                       .watermark = watermark,
                       .group_windows = std::move(group_windows),
                       .num_state_slots = num_state_slots,
                       .num_state_snapshots = num_state_snapshots,
                       .state_backups = state_backups});
           }),
           py::arg("num_blocks"), py::arg("block_size") = 16,
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.01,
           py::arg("group_windows") = std::vector<int64_t>{0}, py::arg("num_state_slots") = 0,
           py::arg("num_state_snapshots") = 0, py::arg("state_backups") = false,
           "group_windows: per group of layers its sliding window in tokens (0: full attention). "
           "num_state_slots: state slots of a model with state-space layers (0: none). "
           "num_state_snapshots: slots for states saved at block boundaries (prefix hits of such "
           "a model; 0: none, and prefix caching must then be off). state_backups: a backup slot "
           "per sequence slot (speculative decoding over state-space layers).")
      .def("can_allocate", &M::can_allocate, py::arg("prompt_tokens"), py::arg("extra_key") = 0,
           py::arg("num_scheduled") = -1, py::arg("num_states") = 1)
      .def("allocate", &M::allocate, py::arg("seq_id"), py::arg("prompt_tokens"),
           py::arg("extra_key") = 0, py::arg("num_scheduled") = -1, py::arg("num_states") = 1,
           "Returns how many prompt tokens the prefix cache holds.")
      .def("state_slot", &M::state_slot, py::arg("seq_id"))
      .def("take_state_copies", &M::take_state_copies)
      .def("num_state_slots", &M::num_state_slots)
      .def("num_free_state_slots", &M::num_free_state_slots)
      .def("snapshot_state", &M::snapshot_state, py::arg("seq_id"), py::arg("end"),
           "The StateCopy into a snapshot slot to do after the step, or None.")
      .def("commit_state_snapshots", &M::commit_state_snapshots)
      .def("snapshot_boundary", &M::snapshot_boundary, py::arg("seq_id"))
      .def("discard_state_snapshots", &M::discard_state_snapshots)
      .def("num_state_snapshots", &M::num_state_snapshots)
      .def("num_cached_states", &M::num_cached_states)
      .def("num_state_pool_slots", &M::num_state_pool_slots)
      .def("back_up_state", &M::back_up_state, py::arg("seq_id"),
           "The StateCopy of the sequence's state into its backup slot, to do before a step that "
           "verifies drafts.")
      .def("restore_state", &M::restore_state, py::arg("seq_id"), py::arg("num_computed_tokens"),
           "Queues the copy back (take_state_copies) and sets the computed tokens back.")
      .def("can_reserve_prefill", &M::can_reserve_prefill, py::arg("seq_id"), py::arg("end"))
      .def("reserve_prefill", &M::reserve_prefill, py::arg("seq_id"), py::arg("end"))
      .def("can_append_slots", &M::can_append_slots, py::arg("seq_id"), py::arg("num_new_tokens"),
           py::arg("num_lookahead") = 0)
      .def("append_slots", &M::append_slots, py::arg("seq_id"), py::arg("new_tokens"),
           py::arg("num_lookahead") = 0,
           "Returns the BlockCopy list to apply to the KV tensors before the step; reserves "
           "num_lookahead slots after the tokens (speculative drafts).")
      .def("mark_computed", &M::mark_computed, py::arg("seq_id"), py::arg("num_computed_tokens"))
      .def("fork", &M::fork, py::arg("parent_id"), py::arg("child_id"))
      .def("free", &M::free, py::arg("seq_id"))
      .def("reset_prefix_cache", &M::reset_prefix_cache)
      .def("check_invariants", &M::check_invariants)
      .def("num_blocks", &M::num_blocks)
      .def("block_size", &M::block_size)
      .def("num_usable_blocks", &M::num_usable_blocks)
      .def("num_free_blocks", &M::num_free_blocks)
      .def("usage", &M::usage)
      .def("num_cached_blocks", &M::num_cached_blocks)
      .def("prefix_cache_queries", &M::prefix_cache_queries)
      .def("prefix_cache_hits", &M::prefix_cache_hits)
      .def("num_evictions", &M::num_evictions)
      .def("free_block_ids", &M::free_block_ids)
      .def("ref_count", &M::ref_count, py::arg("block_id"))
      .def("has_sequence", &M::has_sequence, py::arg("seq_id"))
      .def("num_sequences", &M::num_sequences)
      .def("block_table", &M::block_table, py::arg("seq_id"), py::arg("group") = 0)
      .def("num_live_blocks", &M::num_live_blocks, py::arg("seq_id"), py::arg("group"))
      .def("num_groups", &M::num_groups)
      .def("group_window", &M::group_window, py::arg("group"))
      .def("max_blocks_held",
           py::overload_cast<int64_t, int64_t, int64_t>(&M::max_blocks_held, py::const_),
           py::arg("num_prompt"), py::arg("num_tokens"), py::arg("max_chunk"),
           "Blocks (all groups) a sequence of num_prompt prompt tokens, prefilled in chunks of at "
           "most max_chunk, holds at most until it has num_tokens.")
      .def_static("max_blocks_held_for",
                  py::overload_cast<const std::vector<int64_t>&, int64_t, int64_t, int64_t,
                                    int64_t>(&M::max_blocks_held),
                  py::arg("group_windows"), py::arg("block_size"), py::arg("num_prompt"),
                  py::arg("num_tokens"), py::arg("max_chunk"),
                  "max_blocks_held of a manager with these groups and block size.")
      .def("num_tokens", &M::num_tokens, py::arg("seq_id"))
      .def("num_lookahead", &M::num_lookahead, py::arg("seq_id"))
      .def("num_computed_tokens", &M::num_computed_tokens, py::arg("seq_id"))
      .def("__repr__", [](const M& m) {
        return "PagedBlockManager(num_blocks=" + std::to_string(m.num_blocks()) +
               ", block_size=" + std::to_string(m.block_size()) +
               ", num_free_blocks=" + std::to_string(m.num_free_blocks()) +
               ", num_sequences=" + std::to_string(m.num_sequences()) + ")";
      });
}

}  // namespace kvserve::bindings
