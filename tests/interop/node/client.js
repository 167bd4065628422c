// A Node client of rcoder: loads proto/ as shipped (no generated code) and streams one Chat turn.
//
//   node client.js <host:port> '<ChatRequest as JSON, proto field names>'
//
// Prints every ChatStream message as one JSON line; on an error status prints
// {"error": {code, details, errorInfo}} and exits 1. Used by tests/interop/test_node_client.py.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_DIR = path.resolve(__dirname, "..", "..", "..", "proto");

const definition = protoLoader.loadSync("rcoder/v1/agent_runner.proto", {
  includeDirs: [PROTO_DIR], // google/protobuf/*.proto come with proto-loader
  keepCase: true, // field names as in the .proto: project_id, session_id, ...
  longs: String, // uint64 seq as a string, like every JSON mapping of protobuf
  enums: String, // "RESUME_OUTCOME_NEW", not 1
  oneofs: true, // each message says which event it carries: message.event === "started"
});
const rcoder = grpc.loadPackageDefinition(definition).rcoder.v1;

// The google.rpc.ErrorInfo of an error status: grpc-status-details-bin is a google.rpc.Status
// whose details are Any messages (three small types, declared here rather than fetched).
const richStatus = protobuf.Root.fromJSON({
  nested: {
    Status: {
      fields: {
        code: { type: "int32", id: 1 },
        message: { type: "string", id: 2 },
        details: { rule: "repeated", type: "Any", id: 3 },
      },
    },
    Any: { fields: { type_url: { type: "string", id: 1 }, value: { type: "bytes", id: 2 } } },
    ErrorInfo: {
      fields: {
        reason: { type: "string", id: 1 },
        domain: { type: "string", id: 2 },
        metadata: { keyType: "string", type: "string", id: 3 },
      },
    },
  },
});

function errorInfo(error) {
  const raw = error.metadata && error.metadata.get("grpc-status-details-bin")[0];
  if (!raw) return null;
  const ErrorInfo = richStatus.lookupType("ErrorInfo");
  for (const detail of richStatus.lookupType("Status").decode(raw).details) {
    if (detail.type_url.endsWith("/google.rpc.ErrorInfo")) return ErrorInfo.toObject(ErrorInfo.decode(detail.value));
  }
  return null;
}

function main() {
  const [target, requestJson] = process.argv.slice(2);
  const metadata = new grpc.Metadata();
  if (process.env.RCODER_TOKEN) metadata.set("authorization", `Bearer ${process.env.RCODER_TOKEN}`);
  const client = new rcoder.AgentRunner(target, grpc.credentials.createInsecure());
  const call = client.Chat(JSON.parse(requestJson), metadata);
  call.on("data", (message) => process.stdout.write(JSON.stringify(message) + "\n"));
  call.on("error", (error) => {
    const out = { error: { code: grpc.status[error.code], details: error.details, errorInfo: errorInfo(error) } };
    process.stdout.write(JSON.stringify(out) + "\n");
    process.exitCode = 1;
  });
  call.on("end", () => client.close());
}

main();
