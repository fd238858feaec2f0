// The resume rules in-process, on every rank: which checkpoint --resume names (resolve_resume),
// the later checkpoints of an abandoned continuation set aside (set_aside_later_checkpoints), the
// settings a resume may change (check_resume_settings), the metrics file continued at the resumed
// step (continue_metrics) and the tokenizer the new checkpoints record (pick_tokenizer). The
// end-to-end script tests/e2e/test_resume_rules.sh keeps what only the binary shows (the log, exit
// statuses, a real run continued). Run under mpirun at 1, 2, 3 and 4 ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../src/train/resume.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/runtime/runtime.h"
#include "shardtrain/train/train.h"
#include "rank_test.h"

namespace st = shardtrain;
namespace fs = std::filesystem;

namespace {

st::Comm& world() { return st::testing::comm(); }
bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The message of the CollectiveError `fn` throws on this rank; "(no throw)" or "(other)" otherwise.
template <typename F> std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const st::CollectiveError& e) {
    return e.what();
  } catch (...) {
    return "(other)";
  }
  return "(no throw)";
}

// A fresh directory every rank sees; rank 0 alone changes files in it, between world barriers.
class Resume : public st::testing::TempDirTest {
 protected:
  // Rank 0 writes `bytes` to dir/name; every rank returns after it is there.
  void put(const std::string& name, const std::string& bytes) {
    if (world().rank() == 0) std::ofstream(dir_ + "/" + name, std::ios::binary) << bytes;
    world().barrier();
  }
  void remove(const std::string& name) {
    if (world().rank() == 0) fs::remove_all(dir_ + "/" + name);
    world().barrier();
  }
};

}  // namespace

TEST_F(Resume, ResolveResumePicksLatestThenNewestAndRefusesALostLatest) {
  st::Comm& c = world();
  EXPECT_EQ(st::resolve_resume(c, "", dir_), "");
  EXPECT_TRUE(contains(error_of([&] { st::resolve_resume(c, "auto", ""); }), "'--resume auto' needs '--checkpoint-dir'"));
  EXPECT_EQ(st::resolve_resume(c, "auto", dir_), "");  // a first run: nothing there
  put("step_00000002.h5", "x");
  put("step_00000010.h5", "x");
  put(".step_00000012.h5.tmp", "x");  // never published
  if (c.rank() == 0) fs::create_directory(dir_ + "/step_00000011.h5");  // not a regular file
  c.barrier();
  EXPECT_EQ(st::resolve_resume(c, "auto", dir_), dir_ + "/step_00000010.h5");  // no `latest`: the newest
  put("latest", "step_00000002.h5\r\n");
  EXPECT_EQ(st::resolve_resume(c, "auto", dir_), dir_ + "/step_00000002.h5");  // `latest` wins (rolled back)
  put("latest", "step_00000005.h5\n");
  std::string e = error_of([&] { st::resolve_resume(c, "auto", dir_); });
  EXPECT_TRUE(contains(e, "names 'step_00000005.h5', which does not exist")) << e;
  EXPECT_TRUE(contains(e, "'--resume " + dir_ + "/step_00000010.h5'")) << e;
  put("latest", "../../etc/passwd\n");
  e = error_of([&] { st::resolve_resume(c, "auto", dir_); });
  EXPECT_TRUE(contains(e, "is damaged")) << e;
  // Every checkpoint gone: refused unless --start-over, which starts at step 0.
  remove("step_00000002.h5");
  remove("step_00000010.h5");
  remove("step_00000011.h5");
  put("latest", "step_00000010.h5\n");
  e = error_of([&] { st::resolve_resume(c, "auto", dir_); });
  EXPECT_TRUE(contains(e, "No checkpoint is left")) << e;
  EXPECT_TRUE(contains(e, "'--start-over'")) << e;
  EXPECT_EQ(st::resolve_resume(c, "auto", dir_, true), "");
  // An explicit path must exist.
  e = error_of([&] { st::resolve_resume(c, dir_ + "/nope.h5", dir_); });
  EXPECT_TRUE(contains(e, "no such file")) << e;
  put("other.h5", "x");
  EXPECT_EQ(st::resolve_resume(c, dir_ + "/other.h5", dir_), dir_ + "/other.h5");
}

TEST_F(Resume, LaterCheckpointsOfAnAbandonedRunAreSetAside) {
  st::Comm& c = world();
  for (const char* n : {"step_00000002.h5", "step_00000004.h5", "step_00000006.h5", "step_00000008.h5"}) put(n, n);
  put("latest", "step_00000008.h5\n");
  st::set_aside_later_checkpoints(c, dir_, 4, dir_ + "/step_00000004.h5");
  EXPECT_EQ(st::published_checkpoints(dir_), (std::vector<std::string>{"step_00000002.h5", "step_00000004.h5"}));
  EXPECT_EQ(slurp(dir_ + "/abandoned/step_00000006.h5"), "step_00000006.h5");
  EXPECT_EQ(slurp(dir_ + "/abandoned/step_00000008.h5"), "step_00000008.h5");
  EXPECT_EQ(slurp(dir_ + "/latest"), "step_00000004.h5\n");  // points at the checkpoint resumed from
  c.barrier();
  // Resumed from a file elsewhere: later ones still go, `latest` is left alone.
  put("step_00000009.h5", "9");
  put("latest", "step_00000009.h5\n");
  st::set_aside_later_checkpoints(c, dir_, 4, "/elsewhere/step_00000004.h5");
  EXPECT_EQ(st::published_checkpoints(dir_), (std::vector<std::string>{"step_00000002.h5", "step_00000004.h5"}));
  EXPECT_EQ(slurp(dir_ + "/latest"), "step_00000009.h5\n");
  // Nothing later: nothing moves.
  st::set_aside_later_checkpoints(c, dir_, 4, dir_ + "/step_00000004.h5");
  EXPECT_EQ(st::published_checkpoints(dir_).size(), 2u);
}

TEST_F(Resume, ChangedSettingsAreRefusedUnlessAccepted) {
  st::Comm& c = world();
  st::TrainConfig old;
  old.steps = 100;
  old.lr = 1e-3;
  st::CheckpointInfo info;
  info.path = "run/step_00000005.h5";
  info.step = 5;
  info.train_config = st::train_config_json(old);
  EXPECT_EQ(error_of([&] { st::check_resume_settings(c, info, old); }), "(no throw)");
  st::TrainConfig now = old;
  now.steps = 200;
  now.lr = 2e-3;
  std::string e = error_of([&] { st::check_resume_settings(c, info, now); });
  EXPECT_TRUE(contains(e, "--steps 100 -> 200")) << e;
  EXPECT_TRUE(contains(e, "--lr 0.001 -> 0.002")) << e;
  EXPECT_TRUE(contains(e, "'--accept-change steps,lr'")) << e;
  EXPECT_TRUE(contains(e, "at step 5")) << e;
  now.accept_changes = {"steps"};
  e = error_of([&] { st::check_resume_settings(c, info, now); });
  EXPECT_TRUE(contains(e, "'--accept-change lr'")) << e;
  EXPECT_FALSE(contains(e, "--steps")) << e;
  now.accept_changes = {"steps", "lr"};
  EXPECT_EQ(error_of([&] { st::check_resume_settings(c, info, now); }), "(no throw)");
  // Not checked: they do not change what is trained.
  st::TrainConfig free = old;
  free.micro_batch = 2;
  free.precision = st::Precision::BF16;
  free.eval_every = 7;
  EXPECT_EQ(error_of([&] { st::check_resume_settings(c, info, free); }), "(no throw)");
  // Each checked setting is refused alone (those of chat data against a chat-data checkpoint: a
  // plain one has none of them, and a resume onto other data is the data record's business).
  st::TrainConfig chat = old;
  chat.examples = true;
  st::CheckpointInfo chat_info = info;
  chat_info.train_config = st::train_config_json(chat);
  for (const std::string& opt : st::resume_checked_settings()) {
    const bool examples = opt == "train-on" || opt == "pack" || opt == "max-length-policy" || opt == "shuffle";
    st::TrainConfig t = examples ? chat : old;
    if (opt == "seq-len") t.seq_len += 1;
    else if (opt == "global-batch") t.global_batch += 1;
    else if (opt == "steps") t.steps += 1;
    else if (opt == "lr") t.lr *= 2;
    else if (opt == "min-lr") t.min_lr *= 2;
    else if (opt == "warmup") t.warmup += 1;
    else if (opt == "beta1") t.beta1 = 0.8;
    else if (opt == "beta2") t.beta2 = 0.9;
    else if (opt == "adam-eps") t.eps = 1e-6;
    else if (opt == "weight-decay") t.weight_decay = 0.3;
    else if (opt == "clip") t.clip = 0.5;
    else if (opt == "seed") t.seed += 1;
    else if (opt == "attention-mask") t.attention_mask = st::AttentionMask::Document;
    else if (opt == "aux-loss-scope") t.aux_scope = st::MoeAuxScope::MicroBatch;
    else if (opt == "train-on") t.train_on = st::TrainOn::All;
    else if (opt == "pack") t.pack = st::PackMode::None;
    else if (opt == "max-length-policy") t.max_length = st::MaxLengthPolicy::Drop;
    else if (opt == "shuffle") t.shuffle = false;
    else if (opt == "router-z-loss-coef") t.router_z_loss_coef = 1e-3;
    else ADD_FAILURE() << "no change written for --" << opt;
    e = error_of([&] { st::check_resume_settings(c, examples ? chat_info : info, t); });
    EXPECT_TRUE(contains(e, "'--accept-change " + opt + "'")) << opt << ": " << e;
  }
}

TEST_F(Resume, MetricsContinueAtTheResumedStep) {
  if (world().rank() == 0) {  // not collective: rank 0 owns the metrics file
    const std::string m = dir_ + "/metrics.jsonl";
    EXPECT_EQ(st::continue_metrics(m, 3), "");  // no file yet
    const std::string rows = "{\"step\": 1, \"loss\": 5.0}\n{\"step\": 2, \"loss\": 4.0}\n{\"step\": 3, \"loss\": 3.5}\n"
                             "{\"step\": 3, \"val_loss\": 3.6}\n{\"step\": 4, \"loss\": 3.0}\n{\"step\": 5, \"loss\": 2.5}\n";
    std::ofstream(m, std::ios::binary) << rows << "{\"step\": 6, \"lo";  // torn by a crash
    const std::string note = st::continue_metrics(m, 3);
    EXPECT_TRUE(contains(note, "moved 3 line(s) of steps after 3")) << note;
    EXPECT_EQ(slurp(m), "{\"step\": 1, \"loss\": 5.0}\n{\"step\": 2, \"loss\": 4.0}\n{\"step\": 3, \"loss\": 3.5}\n"
                        "{\"step\": 3, \"val_loss\": 3.6}\n");
    EXPECT_EQ(slurp(m + ".discarded"), "{\"step\": 4, \"loss\": 3.0}\n{\"step\": 5, \"loss\": 2.5}\n{\"step\": 6, \"lo\n");
    const std::string discarded = slurp(m + ".discarded");
    EXPECT_EQ(st::continue_metrics(m, 3), "");  // nothing after step 3 any more
    EXPECT_EQ(slurp(m + ".discarded"), discarded);
  }
}

TEST_F(Resume, TokenizerOfTheNewCheckpoints) {
  st::Comm& c = world();
  st::TokenizerInfo none = st::no_tokenizer(), bytes, sp1, sp1_more, sp2;
  sp1.kind = sp1_more.kind = sp2.kind = "sentencepiece";
  sp1.files["tokenizer.model"] = "model-A";
  sp1_more.files["tokenizer.model"] = "model-A";
  sp1_more.files["tokenizer_config.json"] = "{}";
  sp1_more.files["extra.json"] = "data's";
  sp1.files["extra.json"] = "checkpoint's";
  sp2.files["tokenizer.model"] = "model-B";
  EXPECT_EQ(st::pick_tokenizer(c, sp1, "ck.h5", none, "d.tok").files, sp1.files);  // the data names none
  EXPECT_EQ(st::pick_tokenizer(c, none, "ck.h5", sp2, "d.tok").files, sp2.files);  // the checkpoint names none
  // The same tokenizer.model: the checkpoint's record, the data's other files added, its own kept.
  const st::TokenizerInfo merged = st::pick_tokenizer(c, sp1, "ck.h5", sp1_more, "d.tok");
  EXPECT_EQ(merged.files.size(), 3u);
  EXPECT_EQ(merged.files.at("extra.json"), "checkpoint's");
  EXPECT_EQ(merged.files.at("tokenizer_config.json"), "{}");
  // Another tokenizer.model: refused, naming both files.
  const std::string e = error_of([&] { st::pick_tokenizer(c, sp1, "ck.h5", sp2, "d.tok"); });
  EXPECT_TRUE(contains(e, "token file 'd.tok' was made with another tokenizer")) << e;
  EXPECT_TRUE(contains(e, "checkpoint 'ck.h5'")) << e;
  // Byte-level to a tokenizer of its own: the data's (noted in the log).
  EXPECT_EQ(st::pick_tokenizer(c, bytes, "ck.h5", sp2, "d.tok").kind, "sentencepiece");
  EXPECT_EQ(st::pick_tokenizer(c, sp2, "ck.h5", bytes, "d.tok").kind, "byte-level");
  // Chat data (issue 55) on an imported model with the same tokenizer.json: the data's chat template
  // (the model learns the rendering it was trained on) and the end-of-turn ids of both; the
  // checkpoint's generation_config.json kept.
  st::TokenizerInfo imported, chat;
  imported.kind = chat.kind = "hf-tokenizers";
  imported.files = {{"tokenizer.json", "T"}, {"chat_template.jinja", "stock"}, {"generation_config.json", "{\"a\": 1}"}};
  imported.end_of_turn_ids = {7};
  chat.files = {{"tokenizer.json", "T"}, {"chat_template.jinja", "tuned"}, {"generation_config.json", "{}"}};
  chat.end_of_turn_ids = {2, 7};
  const st::TokenizerInfo tuned = st::pick_tokenizer(c, imported, "ck.h5", chat, "d.tok");
  EXPECT_EQ(tuned.files.at("chat_template.jinja"), "tuned");
  EXPECT_EQ(tuned.files.at("generation_config.json"), "{\"a\": 1}");
  EXPECT_EQ(tuned.end_of_turn_ids, (std::vector<int64_t>{2, 7}));
  chat.files.erase("chat_template.jinja");  // data without a template: the checkpoint's stays
  EXPECT_EQ(st::pick_tokenizer(c, imported, "ck.h5", chat, "d.tok").files.at("chat_template.jinja"), "stock");
}
