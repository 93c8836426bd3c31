// Validates ServiceMonitor / PrometheusRule objects (a JSON array on stdin) with the validators that
// @kubernetes-models/prometheus-operator generates from prometheus-operator's CRD schemas.
// Usage: node validate_prometheus_operator.mjs <node_modules dir>  < objects.json
// Prints one line per object and exits 1 if any is invalid.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const v1 = await import(
  pathToFileURL(join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/index.js")).href
);
const objects = JSON.parse(readFileSync(0, "utf8"));
let failed = 0;
for (const obj of objects) {
  const name = `${obj.kind}/${obj.metadata?.name}`;
  const Model = obj.apiVersion === "monitoring.coreos.com/v1" ? v1[obj.kind] : undefined;
  if (!Model) {
    console.log(`INVALID ${name}: no validator for ${obj.apiVersion} ${obj.kind}`);
    failed++;
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`VALID ${name}`);
  } catch (err) {
    console.log(`INVALID ${name}: ${err.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
