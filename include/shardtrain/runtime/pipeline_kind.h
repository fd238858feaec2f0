// shardtrain pipeline schedule names: the values of '--pp-schedule' and of a checkpoint's
// `pipeline.schedule` attribute. The schedules themselves are the parallel layer's
// (parallel/pipeline_schedule.h); the names sit in the runtime layer, under every layer, so that
// the checkpoint reader (io) and the options (app) can name a schedule without the parallel layer
// (tests/check_layers.py holds the layer order).
#pragma once

#include <string>

namespace shardtrain {

enum class PipelineKind { GPipe, OneFOneB, Interleaved, ZeroBubble };

// "gpipe", "1f1b", "interleaved", "zero-bubble" (the --pp-schedule values); "?" for a value outside the enum.
inline const char* pipeline_kind_name(PipelineKind k) {
  switch (k) {
    case PipelineKind::GPipe: return "gpipe";
    case PipelineKind::OneFOneB: return "1f1b";
    case PipelineKind::Interleaved: return "interleaved";
    case PipelineKind::ZeroBubble: return "zero-bubble";
  }
  return "?";
}

// true and *k set when `name` is one of pipeline_kind_name's values; false (and *k untouched) otherwise.
inline bool parse_pipeline_kind(const std::string& name, PipelineKind* k) {
  for (PipelineKind c : {PipelineKind::GPipe, PipelineKind::OneFOneB, PipelineKind::Interleaved, PipelineKind::ZeroBubble})
    if (name == pipeline_kind_name(c)) return *k = c, true;
  return false;
}

}  // namespace shardtrain
