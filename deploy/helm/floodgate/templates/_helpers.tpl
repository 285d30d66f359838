{{/* The chart's name, or nameOverride. */}}
{{- define "floodgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every resource name: fullnameOverride, else <release>-<name> (or just the
release when it already contains the name). Short enough for the "-agent"/"-rules" suffixes. */}}
{{- define "floodgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 57 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "floodgate.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 57 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 57 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "floodgate.agent.fullname" -}}
{{- printf "%s-agent" (include "floodgate.fullname" .) -}}
{{- end -}}

{{- define "floodgate.rules.fullname" -}}
{{- printf "%s-rules" (include "floodgate.fullname" .) -}}
{{- end -}}

{{- define "floodgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "floodgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Labels of every resource. */}}
{{- define "floodgate.labels" -}}
helm.sh/chart: {{ include "floodgate.chart" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: floodgate
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of a component: include with (dict "ctx" $ "component" "agent"). */}}
{{- define "floodgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "floodgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The rules service's URL the agents follow: agent.rulesUrl, else this chart's service. */}}
{{- define "floodgate.rulesUrl" -}}
{{- if .Values.agent.rulesUrl -}}
{{- .Values.agent.rulesUrl -}}
{{- else if .Values.rules.enabled -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "https" "http" .Values.rules.tls.enabled) (include "floodgate.rules.fullname" .) .Release.Namespace (int .Values.rules.port) -}}
{{- end -}}
{{- end -}}

{{/* The Redis CA file inside the agent container, when one is configured. */}}
{{- define "floodgate.redisCaFile" -}}
{{- if or .Values.redis.tls.caSecret .Values.redis.tls.caConfigMap -}}
{{- printf "/etc/floodgate/redis-ca/%s" .Values.redis.tls.caKey -}}
{{- end -}}
{{- end -}}

{{/* The agent's config file (TOML). Values are written with toJson: a JSON string, number,
boolean or array of them is the same value in TOML. */}}
{{- define "floodgate.agentConfig" -}}
# The agent's settings (`floodgate agent --config /etc/floodgate/agent.toml`): each key is a flag in
# snake case. FLOODGATE_* variables of the container (the image's socket and admin address) and
# flags override it. Rendered by the Helm chart from its values: change those, not this file.
redis = {{ .Values.redis.url | toJson }}
redis_cluster = {{ .Values.redis.cluster | toJson }}
{{- with (include "floodgate.redisCaFile" .) }}
redis_ca = {{ . | toJson }}
{{- end }}
{{- if .Values.redis.passwordSecret.name }}
redis_password_file = {{ printf "/etc/floodgate/redis-password/%s" .Values.redis.passwordSecret.key | toJson }}
{{- end }}
{{- with (include "floodgate.rulesUrl" .) }}
rules_url = {{ . | toJson }}
{{- end }}
{{- if .Values.agent.rulesCa.secretName }}
rules_ca = {{ printf "/etc/floodgate/rules-ca/%s" .Values.agent.rulesCa.key | toJson }}
{{- end }}
{{- if .Values.agent.grpc.enabled }}
grpc = {{ printf "0.0.0.0:%d" (int .Values.agent.grpc.port) | toJson }}
{{- end }}
{{- if .Values.agent.tcp.enabled }}
listen_tcp = {{ printf "0.0.0.0:%d" (int .Values.agent.tcp.port) | toJson }}
{{- end }}
log = {{ .Values.agent.log | toJson }}
log_format = {{ .Values.agent.logFormat | toJson }}
{{- range $key, $value := .Values.agent.extraConfig }}
{{ $key }} = {{ $value | toJson }}
{{- end }}
{{- end -}}
