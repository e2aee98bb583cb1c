{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "prefix-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full resource name: "<release>-<chart>", or the release alone when it already names the chart. */}}
{{- define "prefix-router.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "prefix-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "prefix-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefix-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "prefix-router.labels" -}}
helm.sh/chart: {{ include "prefix-router.chart" . }}
{{ include "prefix-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The image reference: a digest wins over a tag; the tag defaults to the chart's appVersion. */}}
{{- define "prefix-router.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the router discovers backends through the Kubernetes API (needs RBAC and a token). */}}
{{- define "prefix-router.k8sDiscovery" -}}
{{- if eq (toString (dig "discovery" "mode" "static" .Values.config)) "kubernetes" -}}true{{- end -}}
{{- end -}}

{{/* The ServiceAccount the pod runs as; empty means the namespace's default account. */}}
{{- define "prefix-router.serviceAccountName" -}}
{{- if and (include "prefix-router.k8sDiscovery" .) .Values.rbac.create -}}
{{- default (include "prefix-router.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace whose EndpointSlices the router watches (config.discovery.k8s_namespace or the release's). */}}
{{- define "prefix-router.discoveryNamespace" -}}
{{- default .Release.Namespace (dig "discovery" "k8s_namespace" "" .Values.config) -}}
{{- end -}}

{{- define "prefix-router.port" -}}
{{- dig "server" "port" 8080 .Values.config | int -}}
{{- end -}}

{{- define "prefix-router.metricsPort" -}}
{{- with (dig "server" "metrics_port" nil .Values.config) -}}{{ . | int }}{{- end -}}
{{- end -}}

{{- define "prefix-router.drainTimeoutSeconds" -}}
{{- dig "server" "drain_timeout_s" 30 .Values.config | float64 | ceil | int -}}
{{- end -}}

{{/*
The pod's grace period must outlast the preStop sleep plus the router's drain, or the kubelet SIGKILLs
streams the router is still draining. Computed when not given; a given value that is too short fails.
*/}}
{{- define "prefix-router.terminationGracePeriodSeconds" -}}
{{- $drain := dig "server" "drain_timeout_s" 30 .Values.config | float64 -}}
{{- $preStop := .Values.preStopSleepSeconds | int -}}
{{- $needed := addf $preStop $drain -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add $preStop (include "prefix-router.drainTimeoutSeconds" . | int) (.Values.terminationGraceMarginSeconds | int) -}}
{{- else -}}
{{- $given := .Values.terminationGracePeriodSeconds | int -}}
{{- if le ($given | float64) $needed -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) + config.server.drain_timeout_s (%v)" $given $preStop $drain) -}}
{{- end -}}
{{- $given -}}
{{- end -}}
{{- end -}}

{{/*
The shared state store's URL as an env entry of the router container (empty when sharedState is off):
from the given Secret, else the chart's own single-pod Redis.
*/}}
{{- define "prefix-router.sharedStateEnv" -}}
{{- $ss := .Values.sharedState -}}
{{- if $ss.enabled -}}
- name: PREFIX_ROUTER_ROUTING__SHARED_STATE_URL
{{- if $ss.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ $ss.existingSecret }}
      key: {{ $ss.existingSecretKey }}
{{- else if $ss.redis.enabled }}
  value: {{ printf "redis://%s-redis:%d/0" (include "prefix-router.fullname" .) (int $ss.redis.port) | quote }}
{{- else }}
{{- fail "sharedState.enabled needs sharedState.existingSecret (a Secret with the Redis URL) or sharedState.redis.enabled" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The router refuses to start without backends (exit 2), so an install that gives it none would only
crash-loop: refuse it here instead, naming the values to set. Backends come from config.backends, from
discovery (dns, kubernetes), or from a PREFIX_ROUTER_BACKENDS variable in env (envFrom is not looked into:
it may carry one).
*/}}
{{- define "prefix-router.checkBackends" -}}
{{- $static := eq (toString (dig "discovery" "mode" "static" .Values.config)) "static" -}}
{{- $fromEnv := false -}}
{{- range .Values.env -}}
{{- if eq (upper (toString .name)) "PREFIX_ROUTER_BACKENDS" -}}{{- $fromEnv = true -}}{{- end -}}
{{- end -}}
{{- if and $static (not .Values.config.backends) (not $fromEnv) (not .Values.envFrom) -}}
{{- fail "no backends: set config.backends (--set 'config.backends[0].url=http://vllm-0.vllm:8000'), or discover them with config.discovery.mode=dns and config.discovery.dns_name=<headless Service of the vLLM pods>, or config.discovery.mode=kubernetes and config.discovery.k8s_service=<Service>" -}}
{{- end -}}
{{- end -}}
