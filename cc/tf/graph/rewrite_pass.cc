// The graph pass: after partitioning, every cross-task _Send/_Recv that tf_rdma can carry gets the
// "rdma" kernel label, so TensorFlow instantiates RdmaSend/RdmaRecv for it. Each partition is
// rewritten on its own (in TF1 by the worker that owns it), so the decision depends only on what
// both ends of an edge see alike: the devices, the dtype, whether the client feeds or fetches it,
// and the cluster. Edges left to TensorFlow's transport are counted with their reason.
// A labelled _Recv also gets the byte size planned for it (buffer_plan.h), when there is one.
#include <map>
#include <string>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/tf/graph/buffer_plan.h"
#include "cc/tf/kernels/transfer.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/graph.h"

namespace tf_rdma {
namespace {

constexpr char kKernelLabelAttr[] = "_kernel";
constexpr char kLabel[] = "rdma";

bool OnCpu(const std::string& device) { return device.find("/device:CPU:") != std::string::npos; }

// Empty when the edge can go over tf_rdma; otherwise why it stays on TensorFlow's transport.
// Edges within one task return "same task" and are not counted.
std::string Classify(const tensorflow::Node& node, const Runtime& runtime) {
  const tensorflow::AttrSlice attrs = node.attrs();
  std::string send_device, recv_device;
  bool client_terminated = false;
  if (!tensorflow::TryGetNodeAttr(attrs, "send_device", &send_device) ||
      !tensorflow::TryGetNodeAttr(attrs, "recv_device", &recv_device)) {
    return "transfer without device attributes";
  }
  tensorflow::TryGetNodeAttr(attrs, "client_terminated", &client_terminated);
  absl::StatusOr<std::string> send_task = TaskOfDevice(send_device);
  absl::StatusOr<std::string> recv_task = TaskOfDevice(recv_device);
  if (!send_task.ok() || !recv_task.ok()) return "device names without a task";
  if (*send_task == *recv_task) return "same task";
  if (client_terminated) return "fed or fetched by the client";
  if (!runtime.KnowsTask(*send_task) || !runtime.KnowsTask(*recv_task)) {
    return "a task outside the tf_rdma cluster";
  }
  if (!OnCpu(send_device) || !OnCpu(recv_device)) return "not a CPU tensor";
  tensorflow::DataType dtype = tensorflow::DT_INVALID;
  if (!tensorflow::TryGetNodeAttr(attrs, node.IsSend() ? "T" : "tensor_type", &dtype)) {
    return "no dtype attribute";
  }
  if (tensorflow::IsRefType(dtype) || !tensorflow::DataTypeCanUseMemcpy(dtype)) {
    return absl::StrCat("dtype ", tensorflow::DataTypeString(dtype), " is not plain bytes");
  }
  std::string label;
  if (tensorflow::TryGetNodeAttr(attrs, kKernelLabelAttr, &label) && !label.empty() && label != kLabel) {
    return "has another kernel label";
  }
  return "";
}

class RdmaRewritePass : public tensorflow::GraphOptimizationPass {
 public:
  tensorflow::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    Runtime* runtime = Runtime::Get();
    if (runtime == nullptr || options.partition_graphs == nullptr) return absl::OkStatus();
    uint64_t rewritten = 0;
    std::map<std::string, uint64_t> fallback;
    uint64_t planned = 0;
    for (auto& [device, graph] : *options.partition_graphs) {
      for (tensorflow::Node* node : graph->op_nodes()) {
        if (!node->IsSend() && !node->IsRecv()) continue;
        const std::string reason = Classify(*node, *runtime);
        if (reason.empty()) {
          node->AddAttr(kKernelLabelAttr, kLabel);
          ++rewritten;
          const std::optional<int64_t> bytes = node->IsRecv() ? PlannedBytes(*node) : std::nullopt;
          if (bytes) {
            node->AddAttr(kPlannedBytesAttr, *bytes);
            ++planned;
          }
        } else if (reason != "same task") {
          ++fallback[reason];
        }
      }
    }
    if (rewritten == 0 && fallback.empty()) return absl::OkStatus();
    runtime->stats().GraphRewritten(rewritten, planned, fallback);
    std::vector<std::string> reasons;
    for (const auto& [reason, count] : fallback) reasons.push_back(absl::StrCat(count, " ", reason));
    LOG(INFO) << "tf_rdma: graph on " << (runtime->local_task().empty() ? "client" : runtime->local_task())
              << ": " << rewritten << " cross-task transfers over tf_rdma ("
              << planned << " receive buffers planned from static shapes)"
              << (reasons.empty() ? "" : absl::StrCat("; left on gRPC: ", absl::StrJoin(reasons, ", ")));
    return absl::OkStatus();
  }
};

REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_PARTITIONING, 100, RdmaRewritePass);

}  // namespace
}  // namespace tf_rdma
