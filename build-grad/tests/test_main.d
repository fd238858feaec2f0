build-grad/tests/test_main.o: tests/test_main.cpp tests/test_env.h \
 include/shardtrain/runtime.h include/shardtrain/runtime_inl.h
tests/test_env.h:
include/shardtrain/runtime.h:
include/shardtrain/runtime_inl.h:
