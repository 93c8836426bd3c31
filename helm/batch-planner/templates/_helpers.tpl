{{- define "batch-planner.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batch-planner.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service's name; "-headless" fits because fullname is cut to 54 characters. */}}
{{- define "batch-planner.headlessName" -}}
{{- printf "%s-headless" (include "batch-planner.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "batch-planner.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batch-planner.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batch-planner.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "batch-planner.labels" -}}
helm.sh/chart: {{ include "batch-planner.chart" . }}
{{ include "batch-planner.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: planner
{{- end }}

{{- define "batch-planner.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batch-planner.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "batch-planner.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
A config value as the planner's argument parser reads it: Helm reads every YAML number as a float,
so whole numbers are printed as integers (4194304, not 4.194304e+06).
*/}}
{{- define "batch-planner.envValue" -}}
{{- $v := . }}
{{- if and (kindIs "float64" $v) (eq $v (floor $v)) }}
{{- $v | int64 | toString }}
{{- else }}
{{- $v | toString }}
{{- end }}
{{- end }}

{{- define "batch-planner.tlsDir" -}}/etc/batch-planner/tls{{- end }}
{{- define "batch-planner.clientCADir" -}}/etc/batch-planner/client-ca{{- end }}

{{/* Probe handler: native gRPC health check, or a TCP check when the server speaks TLS. */}}
{{/* A native gRPC probe on the plaintext probe port (health only, TLS or not). Argument: a
dict with the root context as "root" and the health service to ask as "service" ("" = ready,
"liveness" = alive). */}}
{{- define "batch-planner.probeHandler" -}}
grpc:
  port: {{ .root.Values.service.probePort }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
