# Builds llama-cpp-python without llama.cpp's `common` library.
#
# llama-cpp-python 0.3.36 forces LLAMA_BUILD_COMMON on (a CACHE FORCE in its
# CMakeLists.txt), so no -D switch turns it off. Its Python package loads only
# libllama and libggml* (and libmtmd with LLAVA_BUILD), never libllama-common,
# which is most of what a CPU build still compiles (chat parsers, argument
# parsing, an HTTP client). Passed as
#
#   CMAKE_ARGS="-DCMAKE_PROJECT_llama.cpp_INCLUDE=/abs/path/no-common.cmake"
#
# CMake includes this file right after llama.cpp's own `project("llama.cpp")`,
# in that directory's scope, where a normal variable hides the forced cache
# entry from the `if (LLAMA_BUILD_COMMON)` tests that follow.
set(LLAMA_BUILD_COMMON OFF)
