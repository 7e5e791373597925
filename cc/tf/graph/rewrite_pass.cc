// The graph pass: after partitioning, every cross-task _Send/_Recv that tf_rdma can carry gets the
// "rdma" kernel label, so TensorFlow instantiates RdmaSend/RdmaRecv for it. Each partition is
// rewritten on its own (in TF1 by the worker that owns it), so the decision depends only on what
// both ends of an edge see alike: the devices, the dtype, whether the client feeds or fetches it,
// and the cluster. Edges left to TensorFlow's transport are counted with their reason.
//
// Where one invocation sees both ends of an edge (TF2: a function partitioned in one process, e.g.
// ParameterServerStrategy's worker part and ps part), the pass also plans the receive buffer from
// the send side's static shape: the _Recv gets the byte size, so its first grant already fits and
// the sender writes into a destination known in advance from the first step (the MSRA design).
// Elsewhere (TF1: each partition is rewritten by the process that owns it, which cannot see the
// other side's shapes) the first transfer of an edge learns the size with one regrant.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/log/log.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cc/tf/kernels/transfer.h"
#include "cc/tf/runtime/runtime.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/algorithm.h"
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

// One transfer as both of its nodes name it.
using EdgeKey = std::tuple<std::string, std::string, std::string>;  // tensor, from, to

EdgeKey KeyOf(const tensorflow::Node& node) {
  std::string tensor, from, to;
  tensorflow::TryGetNodeAttr(node.attrs(), "tensor_name", &tensor);
  tensorflow::TryGetNodeAttr(node.attrs(), "send_device", &from);
  tensorflow::TryGetNodeAttr(node.attrs(), "recv_device", &to);
  return {tensor, from, to};
}

using SendShapes = std::map<EdgeKey, tensorflow::PartialTensorShape>;  // all fully defined

// Adds the static shape of each of `sends` whose input shape inference fixes. Receives whose
// send's shape is already known start from that shape.
void InferSendShapes(const tensorflow::Graph& graph, const std::vector<const tensorflow::Node*>& sends,
                     SendShapes* shapes) {
  tensorflow::ShapeRefiner refiner(graph.versions(), graph.op_registry());
  refiner.set_require_shape_inference_fns(false);
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order);
  for (const tensorflow::Node* node : order) {
    // A node whose shapes cannot be inferred leaves its consumers unknown: only no plan for them.
    if (!refiner.AddNode(node).ok() || !node->IsRecv()) continue;
    auto known = shapes->find(KeyOf(*node));
    if (known == shapes->end()) continue;
    tensorflow::shape_inference::ShapeHandle shape;
    if (refiner.GetContext(node)->MakeShapeFromPartialTensorShape(known->second, &shape).ok()) {
      refiner.SetShape(node, 0, shape).IgnoreError();
    }
  }
  for (const tensorflow::Node* send : sends) {
    const tensorflow::Edge* input = nullptr;
    if (!send->input_edge(0, &input).ok()) continue;
    tensorflow::shape_inference::InferenceContext* context = refiner.GetContext(input->src());
    if (context == nullptr) continue;
    const tensorflow::shape_inference::ShapeHandle shape = context->output(input->src_output());
    if (!context->FullyDefined(shape)) continue;
    std::vector<int64_t> dims;
    for (int i = 0; i < context->Rank(shape); ++i) dims.push_back(context->Value(context->Dim(shape, i)));
    shapes->emplace(KeyOf(*send), tensorflow::PartialTensorShape(dims));
  }
}

// Each partition with the rewritten sends it holds.
using Partitions = std::vector<std::pair<const tensorflow::Graph*, std::vector<const tensorflow::Node*>>>;

// A partition's shapes can depend on what it receives (the worker's gradients on the weights it
// gets from the ps), so partitions are inferred again, with what the last round learned, until a
// round learns nothing new.
SendShapes StaticSendShapes(const Partitions& partitions) {
  SendShapes shapes;
  for (size_t round = 0; round <= partitions.size(); ++round) {
    const size_t known = shapes.size();
    for (const auto& [graph, sends] : partitions) {
      if (!sends.empty()) InferSendShapes(*graph, sends, &shapes);
    }
    if (shapes.size() == known) break;
  }
  return shapes;
}

class RdmaRewritePass : public tensorflow::GraphOptimizationPass {
 public:
  tensorflow::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    Runtime* runtime = Runtime::Get();
    if (runtime == nullptr || options.partition_graphs == nullptr) return absl::OkStatus();
    uint64_t rewritten = 0;
    std::map<std::string, uint64_t> fallback;
    Partitions partitions;
    std::set<EdgeKey> sent;
    std::vector<tensorflow::Node*> recvs;  // those whose send is in this invocation too
    for (auto& [device, graph] : *options.partition_graphs) {
      std::vector<const tensorflow::Node*> sends;
      for (tensorflow::Node* node : graph->op_nodes()) {
        if (!node->IsSend() && !node->IsRecv()) continue;
        const std::string reason = Classify(*node, *runtime);
        if (reason.empty()) {
          node->AddAttr(kKernelLabelAttr, kLabel);
          ++rewritten;
          if (node->IsSend()) {
            sends.push_back(node);
            sent.insert(KeyOf(*node));
          } else {
            recvs.push_back(node);
          }
        } else if (reason != "same task") {
          ++fallback[reason];
        }
      }
      partitions.emplace_back(graph.get(), std::move(sends));
    }
    recvs.erase(std::remove_if(recvs.begin(), recvs.end(),
                               [&](const tensorflow::Node* recv) { return sent.count(KeyOf(*recv)) == 0; }),
                recvs.end());
    uint64_t planned = 0;
    if (!recvs.empty()) {
      const SendShapes shapes = StaticSendShapes(partitions);
      for (tensorflow::Node* recv : recvs) {
        auto shape = shapes.find(KeyOf(*recv));
        tensorflow::DataType dtype;
        if (shape == shapes.end() || !tensorflow::TryGetNodeAttr(recv->attrs(), "tensor_type", &dtype)) continue;
        recv->AddAttr(kPlannedBytesAttr, shape->second.num_elements() * tensorflow::DataTypeSize(dtype));
        ++planned;
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
