#include "cc/tf/planning/static_sizes.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/tf/planning/fusion.h"
#include "cc/tf/runtime/runtime.h"
#include "cc/tf/runtime/task_names.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/rendezvous.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/algorithm.h"

namespace tf_rdma {
namespace {

// On a consumer: per input port, the bytes that input carries when it comes from another task
// and its shape is static; -1 elsewhere.
constexpr char kInputBytesAttr[] = "_rdma_input_bytes";
// Forgetting a plan costs one regrant; remembering every graph ever built could grow unbounded.
constexpr size_t kMaxPlans = 1 << 16;

std::mutex plans_mu;
std::unordered_map<std::string, uint64_t>& Plans() {
  static auto* plans = new std::unordered_map<std::string, uint64_t>();
  return *plans;
}

bool TfRdmaRunsHere() { return !Runtime::Running().empty(); }

class RecordInputBytesPass : public tensorflow::GraphOptimizationPass {
 public:
  tensorflow::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    if (!TfRdmaRunsHere() || options.graph == nullptr || *options.graph == nullptr) return absl::OkStatus();
    tensorflow::Graph& graph = **options.graph;
    std::vector<const tensorflow::Edge*> crossing;
    for (const tensorflow::Edge* edge : graph.edges()) {
      if (!edge->IsControlEdge() &&
          CrossesTasks(edge->src()->assigned_device_name(), edge->dst()->assigned_device_name())) {
        crossing.push_back(edge);
      }
    }
    if (crossing.empty()) return absl::OkStatus();
    tensorflow::ShapeRefiner refiner(graph.versions(), graph.op_registry());
    refiner.set_require_shape_inference_fns(false);
    std::vector<tensorflow::Node*> order;
    tensorflow::GetReversePostOrder(graph, &order);
    // A node whose shapes cannot be inferred leaves its consumers unknown: only no plan for them.
    for (const tensorflow::Node* node : order) refiner.AddNode(node).IgnoreError();
    std::vector<StaticTransfer> static_transfers;
    for (const tensorflow::Edge* edge : crossing) {
      tensorflow::shape_inference::InferenceContext* context = refiner.GetContext(edge->src());
      if (context == nullptr) continue;
      const tensorflow::shape_inference::ShapeHandle shape = context->output(edge->src_output());
      const tensorflow::DataType dtype = tensorflow::BaseType(edge->src()->output_type(edge->src_output()));
      if (!context->FullyDefined(shape) || !tensorflow::DataTypeCanUseMemcpy(dtype)) continue;
      tensorflow::Node* consumer = edge->dst();
      std::vector<int64_t> bytes;
      if (!tensorflow::TryGetNodeAttr(consumer->attrs(), kInputBytesAttr, &bytes)) {
        bytes.assign(consumer->num_inputs(), -1);
      }
      if (edge->dst_input() >= static_cast<int>(bytes.size())) continue;
      bytes[edge->dst_input()] = context->Value(context->NumElements(shape)) * tensorflow::DataTypeSize(dtype);
      consumer->AddAttr(kInputBytesAttr, bytes);
      static_transfers.push_back(StaticTransfer{edge, context->Rank(shape),
                                                static_cast<uint64_t>(bytes[edge->dst_input()])});
    }
    PlanFusion(graph, static_transfers);
    return absl::OkStatus();
  }
};

// The size recorded on the consumer of what `recv` receives.
std::optional<int64_t> RecordedBytes(const tensorflow::Node& recv) {
  for (const tensorflow::Edge* edge : recv.out_edges()) {
    std::vector<int64_t> bytes;
    if (edge->IsControlEdge() || edge->src_output() != 0 ||
        !tensorflow::TryGetNodeAttr(edge->dst()->attrs(), kInputBytesAttr, &bytes) ||
        edge->dst_input() >= static_cast<int>(bytes.size()) || bytes[edge->dst_input()] < 0) {
      continue;
    }
    return bytes[edge->dst_input()];
  }
  return std::nullopt;
}

class FilePlansPass : public tensorflow::GraphOptimizationPass {
 public:
  tensorflow::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    if (!TfRdmaRunsHere() || options.partition_graphs == nullptr) return absl::OkStatus();
    for (auto& [device, graph] : *options.partition_graphs) {
      NameFusedTransfers(*graph);
      for (const tensorflow::Node* node : graph->op_nodes()) {
        if (!node->IsRecv()) continue;
        std::string send_device, recv_device, tensor_name;
        int64_t incarnation = 0;
        const tensorflow::AttrSlice attrs = node->attrs();
        if (!tensorflow::TryGetNodeAttr(attrs, "send_device", &send_device) ||
            !tensorflow::TryGetNodeAttr(attrs, "recv_device", &recv_device) ||
            !tensorflow::TryGetNodeAttr(attrs, "tensor_name", &tensor_name) ||
            !tensorflow::TryGetNodeAttr(attrs, "send_device_incarnation", &incarnation) ||
            !CrossesTasks(send_device, recv_device)) {
          continue;
        }
        const std::optional<int64_t> bytes = RecordedBytes(*node);
        if (!bytes) continue;
        // The rendezvous key as TensorFlow spells it, less its frame and iteration.
        const std::string key = tensorflow::Rendezvous::CreateKey(send_device, static_cast<uint64_t>(incarnation),
                                                                  recv_device, tensor_name, tensorflow::FrameAndIter(0, 0));
        std::lock_guard<std::mutex> lock(plans_mu);
        if (Plans().size() >= kMaxPlans) Plans().clear();
        Plans()[key.substr(0, key.rfind(';'))] = static_cast<uint64_t>(*bytes);
      }
    }
    return absl::OkStatus();
  }
};

REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, 100, RecordInputBytesPass);
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_PARTITIONING, 100, FilePlansPass);

}  // namespace

std::optional<uint64_t> PlannedBytes(const std::string& transfer) {
  std::lock_guard<std::mutex> lock(plans_mu);
  auto it = Plans().find(transfer);
  if (it == Plans().end()) return std::nullopt;
  return it->second;
}

}  // namespace tf_rdma
