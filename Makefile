# GaaS: `make run` starts everything, `make test` tests it. See README.md.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: help install proto model run test test-unit test-router bench gpu-check envoy-config k8s k8s-rehearsal clean

help:
	@echo "make run     install what is missing, build the local model, start the mesh (Ctrl-C stops it)"
	@echo "make test    install, then run the whole test suite (starts its own Redis, Envoys, vLLM workers), then"
	@echo "             the end-to-end half again on the router path (make test-router runs that alone)"
	@echo "make bench   serving figures against vLLM's server (vllm bench serve), where the mesh's own CPU goes process by"
	@echo "             process (py-spy on the router and the worker's front end), each hop's cost, the routing comparison, the"
	@echo "             KV figures and fleet simulation, metering, QoS under overload, mTLS cost per hop, kill -9 under load, a soak killing every kind of process in turn, the long-context switching cost of sessions,"
	@echo "             what a refused request costs and slow clients at the edge, roll-outs (a breach back to 0%, failed requests"
	@echo "             while promoting and switching, the cost of an apply), autoscaling (a step served by a new worker, scale-in, scale from zero),"
	@echo "             LoRA, structured output, embeddings, score and rerank beside vLLM's server, batches, what a hostile upload or batch costs the shared services, and the SITS2026 scorecard (gaas bench sits: its six dimensions"
	@echo "             on a live mesh beside the seed's columns; also sits.png and sits.html), and how long a newcomer waits (a fresh clone's install, its first and second start, a worker killed until it serves)"
	@echo "             (prints tables, writes bench/results/*.json)"
	@echo "make gpu-check   on a host with NVIDIA GPUs: install, start the mesh (one worker per GPU), stream"
	@echo "             through it, compare with vLLM's own server on the same GPU (bench/results/gpu-check.json),"
	@echo "             then the SITS2026 scorecard on the GPU (bench/results/sits-gpu.json, .png, .html)"
	@echo "make model   build the tiny local model into models/gaas-tiny"
	@echo "make envoy-config   render the Envoy configs of deploy/topology.yaml into envoy/generated/"
	@echo "make k8s     render the Kubernetes manifests (Kustomize) into deploy/k8s/ with their secrets, and validate them"
	@echo "make k8s-rehearsal   run the cpu overlay's pods here, each in its own network namespace (root), stream through"
	@echo "             its ingress with the openai client, kill one pod of each Deployment in turn (docs/kubernetes.md)"

install:
	@bash scripts/install.sh

proto: install
	@$(BIN)/python -m gaas.ops.protogen

model: proto
	@$(BIN)/gaas model build --preset tiny

run: proto
	@$(BIN)/gaas up

test: proto
	$(BIN)/python -m pytest --durations=20 tests
	GAAS_TEST_INGRESS_PATH=router $(BIN)/python -m pytest --durations=20 tests/e2e

test-unit: proto
	$(BIN)/python -m pytest tests/unit

# The end-to-end suite against a mesh on the router path (the router relays every stream).
test-router: proto
	GAAS_TEST_INGRESS_PATH=router $(BIN)/python -m pytest tests/e2e

bench: proto
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.cost
	$(BIN)/python -m bench.extproc_call
	$(BIN)/python -m bench.anchor
	$(BIN)/python -m bench.hops
	$(BIN)/python -m bench.routing
	$(BIN)/python -m bench.kvbench
	$(BIN)/python -m bench.meteringbench
	$(BIN)/python -m bench.qos
	$(BIN)/python -m bench.mtlsbench
	$(BIN)/python -m bench.faults
	$(BIN)/python -m bench.soak
	$(BIN)/python -m bench.sessions
	$(BIN)/python -m bench.edge
	$(BIN)/python -m bench.rollout
	$(BIN)/python -m bench.autoscale
	$(BIN)/python -m bench.lora
	$(BIN)/python -m bench.structured
	$(BIN)/python -m bench.embeddings
	$(BIN)/python -m bench.batches
	$(BIN)/python -m bench.abuse
	$(BIN)/python -m bench.sits
	$(BIN)/python -m bench.startup

gpu-check:
	@bash scripts/gpu-check.sh

envoy-config: proto
	@$(BIN)/gaas envoy render

k8s: proto
	$(BIN)/gaas k8s render
	$(BIN)/gaas k8s validate

k8s-rehearsal: proto
	$(BIN)/gaas k8s rehearse --check

clean:
	rm -rf build gaas/v1 envoy/generated .gaas .pytest_cache
