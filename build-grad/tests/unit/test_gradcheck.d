build-grad/tests/unit/test_gradcheck.o: tests/unit/test_gradcheck.cpp \
 tests/unit/../test_env.h include/shardtrain/runtime.h \
 include/shardtrain/runtime_inl.h include/shardtrain/backend.h \
 include/shardtrain/config.h include/shardtrain/model.h \
 include/shardtrain/shard.h
tests/unit/../test_env.h:
include/shardtrain/runtime.h:
include/shardtrain/runtime_inl.h:
include/shardtrain/backend.h:
include/shardtrain/config.h:
include/shardtrain/model.h:
include/shardtrain/shard.h:
