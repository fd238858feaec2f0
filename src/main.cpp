// shardtrain: options -> mode -> one call into the layer that does the job.
#include <iostream>
#include <thread>

#include "shardtrain/backend.h"
#include "shardtrain/config.h"
#include "shardtrain/data.h"
#include "shardtrain/options.h"
#include "shardtrain/runtime.h"
#include "shardtrain/train.h"

using namespace shardtrain;

namespace {

void run_prepare(Comm& comm, const Options& o) {
  TokenFileHeader h;
  std::string err;
  if (comm.rank() == 0) {  // one writer; the others wait for the agreed outcome
    try {
      h = prepare_token_file(o.inputs, o.out, o.val_fraction);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  all_ok(comm, err.empty(), err);
  log_info(comm, "prepare: wrote '" + o.out + "': " + std::to_string(h.n_train) + " train + " +
                     std::to_string(h.n_val) + " validation tokens (" + h.tokenizer + ", vocab " +
                     std::to_string(h.vocab_size) + ")");
}

void run_train(Comm& comm, const Topology& topo, const Options& o) {
  ModelConfig mc = resolve_model_config(comm, o.model);
  std::unique_ptr<TokenDataset> data;
  agree(comm, [&] { data = std::make_unique<TokenDataset>(o.data); });
  int threads = o.threads > 0 ? o.threads
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / topo.local_size);
  set_blas_threads(threads);
  log_info(comm, "shardtrain: " + std::to_string(topo.world_size) + " ranks (" + std::to_string(topo.local_size) +
                     " on " + topo.host + "), device cpu, " + std::to_string(threads) + " BLAS thread(s) per rank");
  auto be = make_cpu_backend<float>();
  train(comm, *be, mc, o.train, *data);
}

}  // namespace

int main(int argc, char** argv) {
  Runtime rt(&argc, &argv);
  Comm& comm = rt.comm();
  const Topology& topo = rt.topo();
  try {
    Options o = parse_options(comm, argc, argv);
    if (o.help) {
      log_info(comm, o.help_text);
      return 0;
    }
    if (o.mode == "prepare") run_prepare(comm, o);
    else run_train(comm, topo, o);
    comm.barrier();
    return 0;
  } catch (const CollectiveError& e) {
    // Every rank reached the same decision: each exits non-zero with the same message.
    // Print before anyone exits: mpirun tears the job down at the first non-zero exit.
    log_error(topo.rank, topo.world_size, e.what());
    comm.barrier();
    return 1;
  } catch (const std::exception& e) {
    // A failure on this rank alone, outside any agreement: the others may be waiting in a
    // collective, so end the whole job rather than leave it hanging.
    log_error(topo.rank, topo.world_size, std::string(e.what()) + " (unrecoverable on this rank; aborting the job)");
    Runtime::abort(1);
  }
}
