// NVTX: the core's ranges appear under an injection library (tests/nvtx/nvtx_recorder.cpp) and nothing breaks
// without one. The probe runs in a child process: NVTX reads NVTX_INJECTION64_PATH once per process.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "hotloop/nvtx.h"

extern char** environ;

namespace {

int run_probe(const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("NVTX_INJECTION64_PATH=", 0) != 0) env.push_back(kv);
  }
  env.push_back(std::string("HOTLOOP_CUDA_DRIVER=") + HOTLOOP_FAKE_CUDA_PATH);
  for (const auto& kv : extra_env) env.push_back(kv);
  std::vector<char*> envp;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  char* argv[] = {const_cast<char*>(HOTLOOP_NVTX_PROBE_PATH), nullptr};
  pid_t pid;
  if (posix_spawn(&pid, HOTLOOP_NVTX_PROBE_PATH, nullptr, nullptr, argv, envp.data()) != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(Nvtx, RangesAppearUnderAnInjectionLibrary) {
  if (!hotloop::nvtx::compiled_in()) GTEST_SKIP() << "built without the NVTX3 headers";
  std::string out = testing::TempDir() + "hotloop_nvtx_record.txt";
  unlink(out.c_str());
  ASSERT_EQ(run_probe({std::string("NVTX_INJECTION64_PATH=") + HOTLOOP_NVTX_RECORDER_PATH,
                       "HOTLOOP_NVTX_RECORD=" + out}),
            0);
  std::ifstream in(out);
  std::map<std::string, int> count;
  int depth = 0, max_depth = 0;
  for (std::string line; std::getline(in, line);) {
    ++count[line];
    if (line.rfind("push ", 0) == 0) max_depth = std::max(max_depth, ++depth);
    if (line.rfind("pop ", 0) == 0) --depth;
  }
  EXPECT_EQ(count["push hotloop:hotloop.wait"], 2);
  EXPECT_GE(count["push hotloop:hotloop.wait.spin"], 1);
  EXPECT_GE(count["push hotloop:hotloop.wait.park"], 1) << "the first wait times out in its park phase";
  EXPECT_EQ(count["push hotloop:hotloop.step.mark"], 1);
  EXPECT_EQ(count["mark hotloop:hotloop.step.done"], 1);
  EXPECT_EQ(depth, 0) << "every push has its pop";
  EXPECT_EQ(max_depth, 2) << "spin and park nest inside wait";
}

TEST(Nvtx, NothingBreaksWithoutATool) {
  EXPECT_EQ(run_probe({}), 0);
  EXPECT_EQ(run_probe({"NVTX_INJECTION64_PATH=/nonexistent/libtool.so"}), 0);
}

}  // namespace
