build-grad/src/model/llama.o: src/model/llama.cpp \
 include/shardtrain/model.h include/shardtrain/backend.h \
 include/shardtrain/config.h include/shardtrain/shard.h \
 include/shardtrain/runtime.h include/shardtrain/runtime_inl.h \
 include/shardtrain/ops_math.h
include/shardtrain/model.h:
include/shardtrain/backend.h:
include/shardtrain/config.h:
include/shardtrain/shard.h:
include/shardtrain/runtime.h:
include/shardtrain/runtime_inl.h:
include/shardtrain/ops_math.h:
