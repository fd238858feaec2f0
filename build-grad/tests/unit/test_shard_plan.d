build-grad/tests/unit/test_shard_plan.o: tests/unit/test_shard_plan.cpp \
 include/shardtrain/shard.h include/shardtrain/backend.h \
 include/shardtrain/runtime.h include/shardtrain/runtime_inl.h
include/shardtrain/shard.h:
include/shardtrain/backend.h:
include/shardtrain/runtime.h:
include/shardtrain/runtime_inl.h:
